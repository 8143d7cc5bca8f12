"""What a run shows: metrics rows, the trace, logging, the progress bar, the HTML report
and its plots, and the profilers (per-layer costs, per saved tensor).

* :mod:`~trainwright.observe.telemetry`: ``metrics.jsonl``, ``trace.json``, log format,
  :class:`~trainwright.observe.telemetry.RunRecorder`;
* :mod:`~trainwright.observe.progress`, :mod:`~trainwright.observe.report`,
  :mod:`~trainwright.observe.report_plots`;
* :mod:`~trainwright.observe.layer_profile`: per-layer forward/backward time and bytes;
* :mod:`~trainwright.observe.timing`: timing work where it runs (CUDA events on a GPU);
* :mod:`~trainwright.observe.tensor_profile`: every saved tensor's size and lifetime.
* :mod:`~trainwright.observe.flops`: model FLOPs counted from the layers, the devices' peak
  (GPU table or CPU matmul calibration), ``tokens_per_s`` and ``mfu``;
* :mod:`~trainwright.observe.process_memory`: a rank's peak resident memory over a step;
* :mod:`~trainwright.observe.loggers`: TensorBoard and wandb scalars (``[observe] loggers``).

May import: :mod:`trainwright.errors`, :mod:`trainwright.schedule`, :mod:`trainwright.plan`,
:mod:`trainwright.config`.
"""
