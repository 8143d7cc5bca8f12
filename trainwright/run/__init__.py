"""Running a job: the local launcher, one rank's worker, the one
:class:`~trainwright.run.trainer.Trainer`, checkpoints, the Python API and the
single-process reference.

* :mod:`~trainwright.run.launch`, :mod:`~trainwright.run.worker`: start a job, one rank;
* :mod:`~trainwright.run.trainer` (+ ``trainer_setup``): the one trainer, its step, and the
  parts it is built from; :mod:`~trainwright.run.records`: a step's figures on their way to
  rank 0 (metrics, trace, report);
* :mod:`~trainwright.run.update` (+ ``precision``, ``lr``): the optimizer step's rules:
  loss scaling, clipping and the learning rate;
* :mod:`~trainwright.run.evaluate`, :mod:`~trainwright.run.checkpoint`: evaluation, checkpoints
  (+ ``manifest``: what completes a checkpoint and which one a resume takes;
  ``ckpt_writer``: blocking or background saves);
* :mod:`~trainwright.run.api`, :mod:`~trainwright.run.export`: the Python API (``fit``,
  ``load_model``, the ``run_job`` that ``trainwright run`` calls too), ``trainwright export``;
  :mod:`~trainwright.run.plan_file`: ``trainwright run --plan``'s checked configuration;
* :mod:`~trainwright.run.ring_launch`, :mod:`~trainwright.run.ring_torchrun`,
  :mod:`~trainwright.run.ring_node`: token-ring nodes, local or under torchrun;
* :mod:`~trainwright.run.reference`: the single-process oracle; :mod:`~trainwright.run.harness`:
  the trainer without run-directory outputs, for tests and benchmarks.

May import every package but :mod:`trainwright.bench` and :mod:`trainwright.cli`.
"""
