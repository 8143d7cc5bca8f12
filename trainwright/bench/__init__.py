"""Side-by-side benchmarks behind ``trainwright bench NAME``: name -> ``main(args) -> dict``."""


def _pipeline(args):
    from trainwright.bench.pipeline import main

    return main(args)


def _memory(args):
    from trainwright.bench.memory import main

    return main(args)


BENCHMARKS = {"pipeline": _pipeline, "memory": _memory}
