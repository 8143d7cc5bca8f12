"""Processes talking: point-to-point with headers and deadlines, the heartbeat watchdog,
the ``pp x dp`` mesh, device probes, free ports and the multi-process test helper.

* :mod:`~trainwright.dist.collective`: the one way to call a ``torch.distributed``
  collective or transfer (tensors on the device of the group's backend);
* :mod:`~trainwright.dist.comm`: :class:`~trainwright.dist.comm.P2P`, the watchdog;
* :mod:`~trainwright.dist.topology`: the mesh with named axes and its process groups;
* :mod:`~trainwright.dist.mailbox`: per-step records of every rank to rank 0, no collective;
* :mod:`~trainwright.dist.probe`: ``nvidia-smi`` and point-to-point bandwidth probes;
* :mod:`~trainwright.dist.ports`, :mod:`~trainwright.dist.testing` (``run_workers``);
* :mod:`~trainwright.dist.faults`: the tests' fault injection (a process kills itself at
  one configured point), the one place that acts on ``[fault]`` and ``tokenring.kill_*``.

May import: :mod:`trainwright.errors`, :mod:`trainwright.schedule`, :mod:`trainwright.plan`,
:mod:`trainwright.config`, :mod:`trainwright.observe`, :mod:`trainwright.model`.
"""
