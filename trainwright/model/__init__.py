"""Models as ordered layers: graph capture, fork/join clusters, built-in models, data, and
what a configuration builds (layers, optimizer, loss, data).

* :mod:`~trainwright.model.graph`: ``nn.Sequential`` or ``torch.export`` -> layers;
* :mod:`~trainwright.model.clusters`: fork/join clusters of a layer chain;
* :mod:`~trainwright.model.gpt`, :mod:`~trainwright.model.mlp`: built-in models;
* :mod:`~trainwright.model.data`: built-in data sets;
* :mod:`~trainwright.model.build`: layers, optimizer, loss and data from a config.

May import: :mod:`trainwright.errors`, :mod:`trainwright.schedule`, :mod:`trainwright.plan`,
:mod:`trainwright.config`, :mod:`trainwright.observe`.
"""
