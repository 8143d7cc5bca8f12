"""Side-by-side benchmarks behind ``trainwright bench NAME``: name -> ``main(args) -> dict``."""


def _pipeline(args):
    from trainwright.bench.pipeline import main

    return main(args)


BENCHMARKS = {"pipeline": _pipeline}
