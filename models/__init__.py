"""Functional decoders, their configs, weight loaders and tokenizers.

`models` calls attention through an injected function and imports nothing from kvjax.
"""

from models.config import ModelConfig, RopeScaling, param_shapes
from models.decoder import embed, forward_hidden, logits_from_hidden, rms_norm, unstack_layers
from models.rope import apply_rope, rope_tables

__all__ = [
    "ModelConfig",
    "RopeScaling",
    "apply_rope",
    "embed",
    "forward_hidden",
    "logits_from_hidden",
    "param_shapes",
    "rms_norm",
    "rope_tables",
    "unstack_layers",
]
