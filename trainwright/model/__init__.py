"""Models as ordered layers: graph capture, fork/join clusters, built-in models, data, and
what a configuration builds (layers, optimizer, loss, data).

* :mod:`~trainwright.model.graph`: ``nn.Sequential`` or ``torch.export`` -> layers;
* :mod:`~trainwright.model.clusters`: fork/join clusters of a layer chain;
* :mod:`~trainwright.model.hf`, :mod:`~trainwright.model.blocks`: a user's
  ``(module, example_args)`` (Hugging Face or not) and its blocks (``group_by = "auto"``);
* :mod:`~trainwright.model.ties`: tied weights between layers;
* :mod:`~trainwright.model.gpt`, :mod:`~trainwright.model.gpt_split`,
  :mod:`~trainwright.model.mlp`: built-in models; :mod:`~trainwright.model.gpt_profile`:
  the built-in GPT's tensor profiles for the planner; :mod:`~trainwright.model.spec`: any
  ``plan --model SPEC`` (config.json on the meta device, factory, built-in) as cost rows;
* :mod:`~trainwright.model.data`, :mod:`~trainwright.model.text_data`: built-in data sets,
  text files and the user's ``Dataset``; :mod:`~trainwright.model.hf_data`: Hugging Face
  data sets packed into token windows (``data.name = "hf"``);
* :mod:`~trainwright.model.build`: layers, optimizer, loss and data from a config.

May import: :mod:`trainwright.errors`, :mod:`trainwright.schedule`, :mod:`trainwright.plan`,
:mod:`trainwright.config`, :mod:`trainwright.observe`.
"""
