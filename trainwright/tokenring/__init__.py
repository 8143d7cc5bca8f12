"""Seed 002's straggler-tolerant token ring: the ring's state machine, its wire format and
membership (rendezvous, standby, rejoin), over ZeroMQ rather than a process group.

* :mod:`~trainwright.tokenring.ring`: :class:`~trainwright.tokenring.ring.TokenRing`;
* :mod:`~trainwright.tokenring.wire`: frames and the standby's welcome;
* :mod:`~trainwright.tokenring.membership`: rendezvous, epochs, joining.

May import every package below :mod:`trainwright.sync` in the layering (see
``docs/architecture.md``), and :mod:`trainwright.sync`.
"""
