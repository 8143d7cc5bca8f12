"""Planning: numbers in, plans out. Pure modules: no ``torch.distributed``, no CLI, no plots.

* :mod:`~trainwright.plan.memory`: per-layer keep / swap / recompute under a stage's limit;
* :mod:`~trainwright.plan.footprint`: everything a rank holds, walked over its schedule
  (weights, gradients, optimizer state, activations, working sets, buffers, host copies);
* :mod:`~trainwright.plan.fit`: a stage's memory plan held to that walk;
* :mod:`~trainwright.plan.partition`: clusters -> k pipeline stages (the adaptive pipeline's
  threshold rule with least communication, and the min-max optimum);
* :mod:`~trainwright.plan.devices`: device topologies (presets, ``nvidia-smi`` text);
* :mod:`~trainwright.plan.placement`, :mod:`~trainwright.plan.planner`,
  :mod:`~trainwright.plan.simulate`: the peer-swap planner: device mapping,
  planner and event simulator;
* :mod:`~trainwright.plan.stage_inputs`: what each stage puts into the placement search and
  the simulator (memory per layer and tensor, compute times, bytes held and sent);
* :mod:`~trainwright.plan.sharing`: a step replayed as processor sharing of CPU work, for
  ranks that share the host's cores;
* :mod:`~trainwright.plan.calibration`: the step-time terms a profile does not see
  (per-action overhead, transport threads, ranks sharing cores), fitted from a machine's
  timings and cached;
* :mod:`~trainwright.plan.choose`: ``trainwright plan --schedule auto``'s candidate
  schedules (several chunks per rank included) and the best of their plans;
* :mod:`~trainwright.plan.candidates`: ``trainwright plan --model SPEC``'s ranked answer
  (pp x dp, schedule, micro-batches, peer swap; state bytes per parameter).

May import: :mod:`trainwright.errors`, :mod:`trainwright.schedule`.
"""

__all__: list[str] = []
