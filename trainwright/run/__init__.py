"""Running a job: the local launcher, one rank's worker, the one
:class:`~trainwright.run.trainer.Trainer`, checkpoints, the Python API and the
single-process reference.

May import every package but :mod:`trainwright.bench` and :mod:`trainwright.cli`.
"""
