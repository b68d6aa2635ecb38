"""COAT's mixed-granularity FP8 activations (COAT, Xi et al. 2024, Part 2; docs/algorithms.md §4).
COAT's FP8 optimizer states are `hf_lowprec.optim.COATAdamW` (their format `optim.formats.GroupFP8`,
one tensor on its own `optim.coat_adamw.quantize_state`); the strategy is `coat`."""

from .activations import (
    ACTIVATION_GROUP_SIZE,
    compress_activations,
    dequantize_groups,
    quantize_groups,
    saved_activation_bytes,
)

__all__ = [
    "ACTIVATION_GROUP_SIZE",
    "compress_activations",
    "dequantize_groups",
    "quantize_groups",
    "saved_activation_bytes",
]
