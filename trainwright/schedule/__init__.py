"""Pipeline schedules as data: actions, the schedules made of them, their grid, dry runs.

* :mod:`~trainwright.schedule.base`: ``Action(stage, kind, mb)`` and ``ActionKind``, the
  Enum of every kind (compute, transfers, ``SYNC``/``STEP``, migration, peer swap);
* :mod:`~trainwright.schedule.actions`: the GPipe / 1F1B generators (and the lookup of
  every schedule by name), in-flight counts, the step x stage grid;
* :mod:`~trainwright.schedule.migration`: where a live migration acts inside a schedule,
  and the dry-run deadlock check of any schedule;
* :mod:`~trainwright.schedule.peer`: seed 004's peer-swap actions woven into a schedule;
* :mod:`~trainwright.schedule.occupancy`: what each model chunk of a rank holds over a
  step (the per-chunk in-flight counts of interleaved 1F1B and ZB-V).

The simulator (:mod:`trainwright.plan`) and the executor (:mod:`trainwright.pipeline`)
share these definitions. Pure: imports only :mod:`trainwright.errors`.
"""
