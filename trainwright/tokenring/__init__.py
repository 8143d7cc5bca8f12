"""The straggler-tolerant token ring: the ring's state machine, its wire format and
membership (rendezvous, standby, rejoin), over ZeroMQ rather than a process group.

* :mod:`~trainwright.tokenring.ring`: :class:`~trainwright.tokenring.ring.TokenRing`, the
  protocol's receiver thread;
* :mod:`~trainwright.tokenring.token`: the token, the time-outs, the closing rule;
* :mod:`~trainwright.tokenring.links`: the outgoing sockets and sequence numbers;
* :mod:`~trainwright.tokenring.exchange`: the trainer's side (offer, wait, apply);
* :mod:`~trainwright.tokenring.state`: what a ring node checkpoints;
* :mod:`~trainwright.tokenring.wire`: frames and the standby's welcome;
* :mod:`~trainwright.tokenring.membership`: rendezvous, epochs, joining;
* :mod:`~trainwright.tokenring.grace`: the adaptive grace (arrival spread -> wait);
* :mod:`~trainwright.tokenring.sumpass`: the closed sum's chunked pass round the ring;
* :mod:`~trainwright.tokenring.work`: which data unit each node trains (nothing lost);
* :mod:`~trainwright.tokenring.scale`: the alpha-beta model of scale (ring vs DDP).

May import every package below :mod:`trainwright.sync` in the layering (see
``docs/architecture.md``), and :mod:`trainwright.sync`.
"""
