"""The command line: argument parsing and every user-facing print.

``trainwright run | report | schedule | bench | plan | simulate``
(:mod:`~trainwright.cli.main`; ``plan`` and ``simulate`` in
:mod:`~trainwright.cli.plan_commands`, the ranked ``plan --model SPEC`` in
:mod:`~trainwright.cli.plan_model`; ``python -m trainwright.cli`` through ``__main__``).
May import everything.
"""

from trainwright.cli.main import main

__all__ = ["main"]
