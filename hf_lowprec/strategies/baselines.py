"""The classic baselines (docs/algorithms.md §6): FP32, BF16 mixed precision (option D), pure BF16 (option A)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .casting import cast_model, narrow_kept_parameters
from .interface import PrecisionStrategy
from .registry import register
from .support import EngineSupport

__all__ = ["FP32", "BF16Mixed", "BF16Pure", "DeviceAutocast", "bf16_autocast", "device_autocast"]


class DeviceAutocast(contextlib.AbstractContextManager):
    """An autocast on CPU, and on CUDA too when present (each only affects its own device), entered
    on `with` and not before: a context made and never entered leaves autocast as it was. Reusable."""

    def __init__(self, dtype: torch.dtype | None = None, enabled: bool = True) -> None:
        self.dtype, self.enabled = dtype, enabled
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> DeviceAutocast:
        stack = contextlib.ExitStack()
        devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        for device in devices:
            stack.enter_context(torch.autocast(device_type=device, dtype=self.dtype, enabled=self.enabled))
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stacks.pop().__exit__(*exc)


def device_autocast(dtype: torch.dtype) -> DeviceAutocast:
    """`dtype` autocast on CPU, and on CUDA too when present, entered on `with`."""
    return DeviceAutocast(dtype)


def bf16_autocast() -> DeviceAutocast:
    """BF16 autocast on CPU, and on CUDA too when present."""
    return device_autocast(torch.bfloat16)


@register("fp32", summary="everything FP32")
class FP32(PrecisionStrategy):
    """Everything in FP32: parameters, gradients, AdamW states (16 bytes/param)."""

    takes_user_optimizer = True
    support = EngineSupport(
        zero_stages=(0, 1, 2, 3),
        zero_note="FP32 partitions and AdamW states",
        fsdp2=True,
        fsdp2_note="FP32 shards and AdamW states; FP32 all-gather and reduce-scatter",
    )

    def fsdp2_mixed_precision(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy()


@register(
    "bf16-mixed", summary="option D: BF16 autocast, FP32 weights (masters) and AdamW states — what `bf16=True` does"
)
class BF16Mixed(PrecisionStrategy):
    """Option D: BF16 autocast compute over FP32 parameters, FP32 gradients and AdamW states.

    This is what `transformers.TrainingArguments(bf16=True)` does; the FP32 parameters are the master weights.
    """

    compute_dtype = torch.bfloat16
    takes_user_optimizer = True
    support = EngineSupport(
        zero_stages=(0, 1, 2, 3),
        zero_note="FP32 partitions (the masters) and AdamW states; BF16 autocast compute",
        fsdp2=True,
        fsdp2_note="FP32 shards (the masters) and AdamW states; BF16 all-gather, FP32 reduce-scatter",
    )

    def fsdp2_mixed_precision(self) -> Any:
        """FSDP2's own mixed precision: BF16 copies of the FP32 shards are all-gathered and
        computed with (the BF16 autocast stays on for the ops it covers), gradients reduced in FP32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def forward_context(self) -> contextlib.AbstractContextManager:
        return bf16_autocast()


@register("bf16-pure", summary="option A: weights, grads and AdamW states in BF16, nothing compensated")
class BF16Pure(PrecisionStrategy):
    """Option A: weights, gradients and both AdamW states in BF16, plain AdamW arithmetic (8 bytes/param)."""

    param_dtype = torch.bfloat16
    compute_dtype = torch.bfloat16
    bytes_per_param = 8.0
    recasts = True
    # With bf16_master_weights_and_grads the ZeRO partition is the BF16 weight, no FP32 master;
    # DeepSpeed without ZeRO would wrap a BF16 model in FP32 masters.
    support = EngineSupport(
        zero_stages=(1, 2, 3),
        zero_refusal="DeepSpeed without ZeRO keeps FP32 master weights of a BF16 model",
        zero_note="BF16 partitions (bf16_master_weights_and_grads), the optimizer's own state dtypes",
        fsdp2=True,
        fsdp2_note=(
            "BF16 DTensor shards; every state component (m, v, δθ, δv, Kahan's k) sharded like its "
            "parameter in its one-process dtype; BF16 all-gather, gradients averaged in FP32"
        ),
    )

    def convert_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Cast to BF16 but the parameters transformers keeps in FP32, which the optimizer steps as FP32 AdamW."""
        return cast_model(model, torch.bfloat16, keep_fp32_parameters=True)

    def before_sharding(self, model: torch.nn.Module) -> None:
        narrow_kept_parameters(model, self.param_dtype)

    def build_optimizer(self, param_groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.Optimizer:
        from ..optim import PlainAdamW

        return PlainAdamW(param_groups, fused=self.options.fused, **hyper)
