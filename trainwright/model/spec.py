"""The model a plan is made for: a ``--model SPEC`` turned into per-layer cost rows.

``trainwright plan --model SPEC`` takes three kinds of SPEC (:class:`SpecKind`):

* ``BUILTIN``: ``gpt`` or ``mlp`` (the run configuration's built-in model, sized by its
  ``model.*`` keys) or a preset GPT size (``gpt-small``, ``gpt-1.3b``, ``gpt-13b``,
  ``gpt3-175b``);
* ``FACTORY``: ``package.module:function``, as ``model.factory`` in a run configuration;
* ``HF_CONFIG``: a Hugging Face ``config.json``, or a folder holding one. The model is
  built with ``transformers`` on the meta device (no weights, no download), one decoder
  layer deep: every decoder layer of a causal LM has the same shape, so one is profiled and
  repeated, as :func:`~trainwright.model.gpt_profile.gpt_profile` does for the built-in GPT.

Small models (a built-in or factory model of the run configuration) are **measured**: one
micro-batch of the configuration's own data through the real layers
(:func:`~trainwright.observe.tensor_profile.profile_tensors`). Large ones (a preset past
2e8 block parameters, every ``config.json``) are profiled on the **meta device** with
the analytic time per layer of :func:`~trainwright.observe.tensor_profile.profile_tensors_meta`
(FLOPs / device FLOP/s + bytes moved / device memory bandwidth).

Every row's ``param_bytes`` counts each parameter once, on the first layer that holds it
(a tied output head adds nothing), so the rows sum to the model's parameter bytes.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch
from torch import nn

from trainwright.config import Config
from trainwright.errors import ConfigError
from trainwright.model.hf import output_tensor

__all__ = ["SpecKind", "ModelProfile", "spec_kind", "load_spec", "PRESET_MODELS",
           "BUILTIN_NAMES"]

PRESET_MODELS = {
    # name: (n_blocks, d_model, n_heads, context, vocab)
    "gpt-small": (6, 256, 4, 128, 256),
    "gpt-1.3b": (24, 2048, 16, 2048, 50257),
    "gpt-13b": (40, 5120, 40, 2048, 50257),
    "gpt3-175b": (96, 12288, 96, 2048, 50257),
}
BUILTIN_NAMES = ("gpt", "mlp")


class SpecKind(Enum):
    """Where a ``--model SPEC`` comes from."""

    BUILTIN = "builtin"
    FACTORY = "factory"
    HF_CONFIG = "hf-config"


@dataclass
class ModelProfile:
    """What the planner needs of a model, and what identifies it to ``run --plan``."""

    spec: str
    kind: SpecKind
    layers: list
    """:class:`~trainwright.observe.tensor_profile.LayerTensors` rows, in model order."""
    params: int
    """Parameters of the whole model (shared ones once)."""
    param_dtype_bytes: int
    """Bytes of one parameter as profiled (2 for bf16/fp16, 4 for fp32)."""
    tokens_per_sample: int
    """Sequence length (1 for a model whose samples are not token sequences)."""
    meta: bool
    """Profiled on the meta device (analytic times) rather than measured."""
    run_keys: dict = field(default_factory=dict)
    """``section.key`` values a run of this model needs (model and data keys)."""

    def fingerprint(self) -> dict:
        """What ``run --plan`` compares with the model it builds: layers and parameters."""
        return {"spec": self.spec, "layers": len(self.layers), "params": self.params}


def spec_kind(spec: str) -> SpecKind:
    """Which kind ``spec`` is (see the module).

    Raises:
        ConfigError: none of them, with the forms that are accepted.
    """
    if spec in PRESET_MODELS or spec in BUILTIN_NAMES:
        return SpecKind.BUILTIN
    path = Path(spec)
    if path.suffix == ".json" or path.is_dir():
        return SpecKind.HF_CONFIG
    module, sep, attr = spec.partition(":")
    if sep and module and attr and "/" not in module:
        return SpecKind.FACTORY
    raise ConfigError(f"--model {spec!r}: give a built-in name ({', '.join(BUILTIN_NAMES)}, "
                      f"{', '.join(PRESET_MODELS)}), a model factory 'package.module:function' "
                      f"or a Hugging Face config.json (or the folder holding one)")


def load_spec(spec: str, cfg: Config, *, micro_batch_size: int = 1, dtype: str = "float32",
              flops_per_s: float = 125e12, bytes_per_s: float = 900e9,
              meta: bool | None = None, seq_len: int | None = None) -> ModelProfile:
    """Profile the model ``spec`` names (see the module).

    Args:
        spec: the ``--model`` value.
        cfg: the run configuration (its model, data and loss keys size a built-in or factory
            model and give it data).
        micro_batch_size: samples in the profiled micro-batch.
        dtype: parameter and activation dtype of a meta-device profile.
        flops_per_s, bytes_per_s: the device's peak figures for meta-device times.
        meta: force (True) or forbid (False) the meta device for a preset (None: by size).
        seq_len: tokens per sample of a ``config.json`` model (default: its
            ``max_position_embeddings``).

    Raises:
        ConfigError: unknown spec, unreadable config.json, an architecture this cannot cut.
    """
    kind = spec_kind(spec)
    dt = getattr(torch, dtype)
    if kind is SpecKind.HF_CONFIG:
        return _hf_profile(spec, micro_batch_size, dt, flops_per_s, bytes_per_s, seq_len)
    if spec in PRESET_MODELS:
        from trainwright.model.gpt_profile import gpt_profile
        nb, d, h, ctx, vocab = PRESET_MODELS[spec]
        use_meta = meta if meta is not None else d * d * nb * 12 > 2e8
        rows = gpt_profile(nb, d, h, ctx, vocab, micro_batch_size, use_meta, dtype,
                           flops_per_s, bytes_per_s)
        keys = {"model.name": "gpt", "model.n_blocks": nb, "model.d_model": d,
                "model.n_heads": h, "model.context": ctx}
        params = sum(r.param_bytes for r in rows) // dt.itemsize
        return ModelProfile(spec, kind, rows, params, dt.itemsize, ctx, use_meta, keys)
    return _measured(spec, kind, cfg, micro_batch_size)


def _measured(spec: str, kind: SpecKind, cfg: Config, micro_batch_size: int) -> ModelProfile:
    """A built-in or factory model of the run configuration, one micro-batch measured."""
    from trainwright.model.build import build_data, build_model, loss_fn
    from trainwright.observe.tensor_profile import profile_tensors

    d = cfg.to_dict()
    keys: dict = {}
    if kind is SpecKind.FACTORY:
        keys["model.factory"] = spec
    elif spec != cfg.model.name or cfg.model.factory:
        keys.update({"model.name": spec, "model.factory": ""})
    for k, v in keys.items():
        sec, name = k.split(".")
        d[sec][name] = v
    run_cfg = Config.from_dict(d)
    named, module = build_model(run_cfg)
    x, y = build_data(run_cfg).batch(1, micro_batch_size)
    rows = profile_tensors([(n, copy.deepcopy(m)) for n, m in named], x, y, loss_fn(run_cfg))
    _count_shared_once(rows, [m for _, m in named])
    params = sum(p.numel() for p in module.parameters())
    itemsize = next(module.parameters()).element_size()
    tokens = x.shape[1] if x.dim() >= 2 and not x.is_floating_point() else 1
    return ModelProfile(spec, kind, rows, params, itemsize, tokens, False, keys)


def _count_shared_once(rows: list, modules: list[nn.Module]) -> None:
    """``param_bytes`` of each row over the parameters no earlier layer holds."""
    seen: set[int] = set()
    for row, m in zip(rows, modules, strict=True):
        own = [p for p in m.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        row.param_bytes = sum(p.numel() * p.element_size() for p in own)


# ------------------------------------------------------------ Hugging Face config.json
def _read_hf_config(spec: str):
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--model {spec}: no such file {path}; give a Hugging Face "
                          f"config.json or the folder holding one") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--model {spec}: {path} is not JSON ({exc})") from None
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError("--model with a config.json needs transformers; install it with "
                          "`pip install trainwright[hf]`") from None
    if "model_type" not in d:
        raise ConfigError(f"--model {spec}: {path} has no model_type; it is not a Hugging "
                          f"Face model config")
    try:
        return AutoConfig.for_model(**d)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"--model {spec}: transformers cannot read {path} ({exc})") from None


class _Embed(nn.Module):
    """Token (and learned position) embeddings of a causal LM."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None):
        super().__init__()
        self.tokens, self.positions = tokens, positions

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids)
        if self.positions is not None:
            h = h + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return h


class _Decoder(nn.Module):
    """One decoder layer, given the rotary position embeddings it needs (no mask: causal
    attention through the fused kernel, as training runs it)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module | None):
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        kw = {}
        if self.rotary is not None:
            pos = torch.arange(h.shape[1], device=h.device)[None]
            kw["position_embeddings"] = self.rotary(h, pos)
        return output_tensor(self.layer(h, **kw))


class _Head(nn.Sequential):
    """Final norm and the output projection."""


def _parts(model: nn.Module, spec: str) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """``(embed, decoder layers, head)`` of a causal LM built from a config."""
    base = model.base_model
    blocks = [m for m in base.children() if isinstance(m, nn.ModuleList)]
    norm = next((getattr(base, n) for n in ("norm", "ln_f", "final_layer_norm", "final_norm")
                 if isinstance(getattr(base, n, None), nn.Module)), None)
    if len(blocks) != 1 or norm is None or model.get_output_embeddings() is None:
        raise ConfigError(f"--model {spec}: cannot find one list of decoder layers, a final "
                          f"norm and an output head in {type(model).__name__}; plan it through "
                          f"a model factory ('package.module:function') instead")
    positions = getattr(base, "wpe", None)
    return (_Embed(model.get_input_embeddings(), positions), blocks[0],
            _Head(norm, model.get_output_embeddings()))


def _hf_profile(spec: str, micro_batch_size: int, dt: torch.dtype, flops_per_s: float,
                bytes_per_s: float, seq_len: int | None) -> ModelProfile:
    from transformers import AutoModelForCausalLM

    from trainwright.observe.tensor_profile import profile_tensors_meta

    hf = _read_hf_config(spec)
    n_layers = hf.num_hidden_layers
    ctx = next((getattr(hf, k) for k in ("max_position_embeddings", "n_positions", "n_ctx")
                if getattr(hf, k, None)), 2048) if seq_len is None else seq_len
    one = copy.deepcopy(hf)
    one.num_hidden_layers = 1  # every decoder layer has the same shape: build one
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(one, dtype=dt)
    except ValueError as exc:
        raise ConfigError(f"--model {spec}: transformers has no causal LM for this config "
                          f"({str(exc)[:160]})") from None
    embed, blocks, head = _parts(model, spec)
    rotary = getattr(model.base_model, "rotary_emb", None)
    layers = [("embed", embed), ("decoder", _Decoder(blocks[0], rotary)), ("head", head)]
    with torch.device("meta"):
        x = torch.zeros(micro_batch_size, ctx, dtype=torch.long)
    lossf = lambda out, t: nn.functional.cross_entropy(  # noqa: E731
        out.float().flatten(0, 1), t.flatten())
    rows = profile_tensors_meta(layers, x, flops_per_s, bytes_per_s, x, lossf)
    _count_shared_once(rows, [m for _, m in layers])
    out = [rows[0]] + [copy.deepcopy(rows[1]) for _ in range(n_layers)] + [rows[2]]
    for i, r in enumerate(out):
        r.layer = i
        r.name = "embed" if i == 0 else "head" if i == n_layers + 1 else f"layer{i - 1}"
    params = sum(r.param_bytes for r in out) // dt.itemsize
    return ModelProfile(spec, SpecKind.HF_CONFIG, out, params, dt.itemsize, ctx, True,
                        {"model.factory": "", "hf_config": str(Path(spec).resolve())})
