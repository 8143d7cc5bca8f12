"""Pipeline schedules as data: actions, the schedules made of them, their grid, dry runs.

* :mod:`~trainwright.schedule.base`: ``Action(stage, kind, mb)`` and ``ActionKind``, the
  Enum of every kind (compute, transfers, ``SYNC``/``STEP``, migration, peer swap);
* :mod:`~trainwright.schedule.actions`: the GPipe / 1F1B generators (and the lookup of
  every schedule by name), in-flight counts, the step x stage grid;
* :mod:`~trainwright.schedule.interleaved`, :mod:`~trainwright.schedule.zero_bubble`,
  :mod:`~trainwright.schedule.zero_bubble_v`: interleaved 1F1B, ZB-H1/H2 and ZB-V;
* :mod:`~trainwright.schedule.carry`: the weight passes a step may leave to the next;
* :mod:`~trainwright.schedule.dryrun`: the dry-run deadlock check of any schedule (live
  migration's ``MIG_*`` actions included; where they go is :mod:`trainwright.rebalance.moves`);
* :mod:`~trainwright.schedule.peer`: the peer-swap actions woven into a schedule;
* :mod:`~trainwright.schedule.occupancy`: what each model chunk of a rank holds over a
  step (the per-chunk in-flight counts of interleaved 1F1B and ZB-V).

The simulator (:mod:`trainwright.plan`) and the executor (:mod:`trainwright.pipeline`)
share these definitions. Pure: imports only :mod:`trainwright.errors`.
"""
