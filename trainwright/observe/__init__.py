"""What a run shows: metrics rows, the trace, logging, the progress bar, the HTML report
and its plots, and the profilers (per-layer costs, per saved tensor).

* :mod:`~trainwright.observe.telemetry`: ``metrics.jsonl``, ``trace.json``, log format,
  :class:`~trainwright.observe.telemetry.RunRecorder`;
* :mod:`~trainwright.observe.progress`, :mod:`~trainwright.observe.report`,
  :mod:`~trainwright.observe.report_plots`;
* :mod:`~trainwright.observe.layer_profile`: per-layer forward/backward time and bytes;
* :mod:`~trainwright.observe.timing`: timing work where it runs (CUDA events on a GPU);
* :mod:`~trainwright.observe.tensor_profile`: every saved tensor's size and lifetime.

May import: :mod:`trainwright.errors`, :mod:`trainwright.schedule`, :mod:`trainwright.plan`,
:mod:`trainwright.config`.
"""
