"""Pipeline schedules as data: actions, the schedules made of them, their grid, dry runs.

* :mod:`~trainwright.schedule.base`: the action type and the lowering of compute orders;
* :mod:`~trainwright.schedule.actions`: ``Action(kind, mb, peer)`` and the GPipe / 1F1B
  generators, in-flight counts, the step x stage grid;
* :mod:`~trainwright.schedule.zero_bubble`, :mod:`~trainwright.schedule.zero_bubble_v`,
  :mod:`~trainwright.schedule.interleaved`: ZB-H1 / ZB-H2, ZB-V, interleaved 1F1B;
  :mod:`~trainwright.schedule.carry`: last W passes carried into the next step;
* :mod:`~trainwright.schedule.migration`: where a live migration acts inside a schedule,
  and the dry-run deadlock check of any schedule;
* :mod:`~trainwright.schedule.peer`: the peer-swap actions woven into a schedule;
* :mod:`~trainwright.schedule.occupancy`: what each model chunk of a rank holds over a
  step (the per-chunk in-flight counts of interleaved 1F1B and ZB-V).

The simulator (:mod:`trainwright.plan`) and the executor (:mod:`trainwright.pipeline`)
share these definitions. Pure: imports only :mod:`trainwright.errors`.
"""
