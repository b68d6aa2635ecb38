"""COAT: FP8 optimizer states with dynamic range expansion and mixed-granularity FP8 activations
(COAT, Xi et al. 2024; docs/algorithms.md §4). The optimizer is `hf_lowprec.optim.COATAdamW`, the
strategy `coat`."""

from .state import FP8_STATE_DTYPES, FP8GroupState, dequantize_state, expansion_exponent, quantize_state

__all__ = [
    "FP8_STATE_DTYPES",
    "FP8GroupState",
    "dequantize_state",
    "expansion_exponent",
    "quantize_state",
]
