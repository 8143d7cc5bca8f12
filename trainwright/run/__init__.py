"""Running a job: the local launcher, one rank's worker, the one
:class:`~trainwright.run.trainer.Trainer`, checkpoints, the Python API and the
single-process reference.

* :mod:`~trainwright.run.launch`, :mod:`~trainwright.run.worker`: start a job, one rank;
* :mod:`~trainwright.run.trainer` (+ ``trainer_setup``): the one trainer and its set-up;
* :mod:`~trainwright.run.update` (+ ``precision``, ``clip``, ``lr``): the optimizer step
  with loss scaling, clipping and the learning rate;
* :mod:`~trainwright.run.evaluate`, :mod:`~trainwright.run.checkpoint`: evaluation, checkpoints;
* :mod:`~trainwright.run.api`, :mod:`~trainwright.run.export`, :mod:`~trainwright.run.edited`:
  ``fit``, ``load_model``, ``trainwright export`` and edited models rebuilt for loading;
* :mod:`~trainwright.run.ring_launch`, :mod:`~trainwright.run.ring_torchrun`,
  :mod:`~trainwright.run.ring_node`: token-ring nodes, local or under torchrun;
* :mod:`~trainwright.run.reference`: the single-process oracle; :mod:`~trainwright.run.harness`:
  the trainer without run-directory outputs, for tests and benchmarks.

May import every package but :mod:`trainwright.bench` and :mod:`trainwright.cli`.
"""
