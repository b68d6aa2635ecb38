"""FP8-LM building blocks: scaled FP8 tensors, FP8 linear layers, gradient auto-scaling,
FP8 all-reduce (FP8-LM §2; docs/algorithms.md §3). The FP8 optimizer is `hf_lowprec.optim.FP8AdamW`."""

from .comm import (
    AllReduceStats,
    FP8AllReduceResult,
    FP8CommState,
    all_gather_owned_fp8,
    fp8_allreduce,
    fp8_allreduce_hook,
    postscale_allreduce,
    prescale_allreduce,
)
from .convert import convert_to_fp8
from .gradients import GradientAutoScaler, quantize_gradient
from .linear import FP8Linear, fp8_gemm_path, fp8_linear, set_fp8_gemm_path
from .payoff import PayoffRule, payoff_rule
from .scaled import (
    FORMATS,
    ScaledTensor,
    count_saturated,
    dequantize,
    format_dtype,
    format_max,
    get_master_scale,
    pow2_scale,
    quantize,
    quantize_counting,
    set_master_scale,
    tensor_amax,
)
from .second_order import DoubleBackwardError

__all__ = [
    "AllReduceStats",
    "DoubleBackwardError",
    "FORMATS",
    "FP8AllReduceResult",
    "FP8CommState",
    "all_gather_owned_fp8",
    "FP8Linear",
    "GradientAutoScaler",
    "PayoffRule",
    "ScaledTensor",
    "convert_to_fp8",
    "count_saturated",
    "dequantize",
    "format_dtype",
    "format_max",
    "fp8_allreduce",
    "fp8_allreduce_hook",
    "fp8_gemm_path",
    "fp8_linear",
    "payoff_rule",
    "get_master_scale",
    "pow2_scale",
    "postscale_allreduce",
    "prescale_allreduce",
    "quantize",
    "quantize_counting",
    "quantize_gradient",
    "set_fp8_gemm_path",
    "set_master_scale",
    "tensor_amax",
]
