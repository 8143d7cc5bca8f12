"""``python -m trainwright``: the command line."""

from trainwright.cli.main import main

raise SystemExit(main())
