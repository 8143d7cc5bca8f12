"""trainwright: pipeline- and data-parallel training when memory and network are the limit.

Quick start::

    import trainwright
    run_dir = trainwright.fit(overrides=["parallel.pp=2", "train.steps=50"])
    model = trainwright.load_model(run_dir)

Beside the sub-packages (their order in ``docs/architecture.md``): :mod:`trainwright.errors`,
the error types every package raises, and ``__main__`` (``python -m trainwright``, the
command line).
"""

__version__ = "0.1.0"
__all__ = ["fit", "load_model", "__version__"]


def __getattr__(name: str):
    # lazy, so `import trainwright` stays cheap (torch is imported on first use)
    if name in ("fit", "load_model"):
        from trainwright.run import api

        return getattr(api, name)
    raise AttributeError(f"module 'trainwright' has no attribute {name!r}")
