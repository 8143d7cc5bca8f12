"""Built-in models, each an ordered list of layers."""

from trainwright.models.gpt import GPTConfig, gpt_layers
from trainwright.models.mlp import mlp_layers

__all__ = ["GPTConfig", "gpt_layers", "mlp_layers"]
