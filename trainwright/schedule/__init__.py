"""Pipeline schedules as data: actions, the schedules made of them, their grid, dry runs.

* :mod:`~trainwright.schedule.actions`: ``Action(kind, mb, peer)`` and the GPipe / 1F1B
  generators, in-flight counts, the step x stage grid;
* :mod:`~trainwright.schedule.dryrun`: the dry-run deadlock check of any schedule (live
  migration's ``MIG_*`` actions included; where they go is :mod:`trainwright.rebalance.moves`);
* :mod:`~trainwright.schedule.peer`: seed 004's peer-swap actions woven into a schedule;
* :mod:`~trainwright.schedule.occupancy`: what each model chunk of a rank holds over a
  step (the per-chunk in-flight counts of interleaved 1F1B and ZB-V).

The simulator (:mod:`trainwright.plan`) and the executor (:mod:`trainwright.pipeline`)
share these definitions. Pure: imports only :mod:`trainwright.errors`.
"""
