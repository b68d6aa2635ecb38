"""COAT AdamW: both moments in per-group FP8 with dynamic range expansion (COAT §Part 1; ALGORITHMS.md §4).

Per parameter θ with gradient g, step t; m and v are decoded to FP32, updated, and encoded
again with `hf_lowprec.coat.quantize_state` (fresh per-group s, k, c every step):

    m ← β1·m + (1 − β1)·g          stored E4M3, groups of 128
    v ← β2·v + (1 − β2)·g²         stored E4M3 (or E5M2), groups of 128
    Δθ = −α·(m̂/(√v̂ + ε) + λ·θ)    `adamw_delta`, in FP32

Master weights: FP32 parameters take θ ← θ + Δθ in FP32 (COAT). BF16/FP16 parameters are
kept as the Collage-light pair (θ, δθ) and take (θ, δθ) ← Grow((θ, δθ), Δθ), the update of
`CollageAdamW(variant="light")` (Collage Alg. 2), which COAT does not offer.

Model-state bytes per parameter (+ 0.19 for the FP32 (s, k, c) of two states, + padding of
tensors whose size is not a multiple of 128):
FP32 master: 4 (θ) + 4 (g) + 1 (m) + 1 (v) = 10; BF16 + δθ: 2 + 2 + 2 (δθ) + 1 + 1 = 8.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from ..coat.state import FP8GroupState, quantize_state
from ..fp8.scaled import format_dtype
from ..numerics import LOW_PRECISION_DTYPES, foreach_grow_
from .collage import AdamWBase, Tensors, adamw_delta, adamw_moments_
from .kernels import FusedMode, compiled_coat_adamw

__all__ = ["COATAdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq")
# Per-group metadata stored next to each FP8 payload, as plain tensors (weights_only loading).
_META = ("scale", "exponent", "center")
_FP8_FORMATS = ("e4m3", "e5m2")


def _load(state: dict[str, Any], key: str, param: torch.Tensor, group: dict[str, Any]) -> FP8GroupState:
    return FP8GroupState(
        state[key], state[f"{key}_scale"], state[f"{key}_exponent"], state[f"{key}_center"],
        tuple(param.shape), group["group_size"], group["expand"],
    )  # fmt: skip


def _store(state: dict[str, Any], key: str, encoded: FP8GroupState) -> None:
    state[key] = encoded.payload
    for field in _META:
        state[f"{key}_{field}"] = getattr(encoded, field)


class COATAdamW(AdamWBase):
    """AdamW with FP8 per-group moments (dynamic range expansion) and FP32 or BF16+δθ masters.

    Args:
        params: FP32 parameters (FP32 masters), or BF16/FP16 parameters (Collage-light δθ).
        lr, betas, eps, weight_decay: as in `torch.optim.AdamW` (decoupled weight decay).
        group_size: elements per quantization group (COAT: 128).
        exp_avg_sq_format: "e4m3" (COAT default) or "e5m2" for v; m is always E4M3.
        expand: dynamic range expansion; False stores plain per-group FP8 (for comparison).
        fused: "auto" (the compiled `kernels.coat_kernel` where it can run, else the reference),
            "compiled" (require it) or "foreach" (the eager reference below); same bits.

    State per parameter: `step` (int); for m ("exp_avg") and v ("exp_avg_sq") the FP8 payload
    (flat, padded to a multiple of `group_size`) and FP32 `_scale`, `_exponent` (k), `_center`
    (c) per group; `param_error` δθ for BF16/FP16 parameters. All plain tensors, restored in
    their own dtypes by `load_state_dict`.
    """

    param_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    extra_options: ClassVar[tuple[str, ...]] = ("group_size", "exp_avg_sq_format", "expand")
    compensation_key: ClassVar[str | None] = "param_error"
    # The step decodes m and v to FP32 and forms Δθ and the moment update's scratch: about 16
    # bytes of working memory per element. Over the whole model at once that transient was
    # 1.5× bf16-mixed's peak RSS on GPT-2 124M; 4M elements per call bound it to ~64 MB
    # (element-wise arithmetic, so the same bits).
    bucket_numel: ClassVar[int | None] = 1 << 22
    state_roles: ClassVar[dict[str, str]] = {
        "exp_avg": "optimizer",
        "exp_avg_sq": "optimizer",
        **{f"{k}_{m}": "extra" for k in _MOMENTS for m in _META},
        "param_error": "extra",
    }

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        group_size: int = 128,
        exp_avg_sq_format: str = "e4m3",
        expand: bool = True,
        fused: FusedMode = "auto",
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, fused=fused,
            group_size=group_size, exp_avg_sq_format=exp_avg_sq_format, expand=expand,
        )  # fmt: skip

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        size = group["group_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"COATAdamW: group_size must be a positive integer, got {size!r} (COAT uses 128)")
        if group["exp_avg_sq_format"] not in _FP8_FORMATS:
            raise ValueError(
                f"COATAdamW: exp_avg_sq_format must be 'e4m3' or 'e5m2', got {group['exp_avg_sq_format']!r}"
            )
        if not isinstance(group["expand"], bool):
            raise ValueError(f"COATAdamW: expand must be True or False, got {group['expand']!r}")

    def _dtypes(self, group: dict[str, Any]) -> dict[str, torch.dtype]:
        return {"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": format_dtype(group["exp_avg_sq_format"])}

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = {"step": 0}
        for key, dtype in self._dtypes(group).items():
            zeros = FP8GroupState.zeros(
                param.shape, group_size=group["group_size"], fp8_dtype=dtype, expand=group["expand"], device=param.device
            )
            _store(state, key, zeros)
        if param.dtype in LOW_PRECISION_DTYPES:
            state["param_error"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _update_bucket(
        self,
        group: dict[str, Any],
        params: Tensors,
        grads: Tensors,
        states: list[dict[str, Any]],
        steps: list[int],
        updates_out: Tensors | None,
    ) -> None:
        beta1, beta2 = group["betas"]
        exp_avgs = [_load(s, "exp_avg", p, group).dequantize() for p, s in zip(params, states)]
        exp_avg_sqs = [_load(s, "exp_avg_sq", p, group).dequantize() for p, s in zip(params, states)]
        # The decoded moments are FP32, so the shared moment update works on them in place.
        adamw_moments_(exp_avgs, exp_avg_sqs, grads, beta1=beta1, beta2=beta2)
        delta = adamw_delta(
            [p.float() for p in params], exp_avgs, exp_avg_sqs, steps,
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
        )  # fmt: skip
        if updates_out is not None:
            updates_out.extend(d.clone() for d in delta)
        if params[0].dtype in LOW_PRECISION_DTYPES:
            errors = [s["param_error"] for s in states]
            foreach_grow_(params, errors, [d.to(params[0].dtype) for d in delta])
        else:
            torch._foreach_add_(params, delta)
        dtypes = self._dtypes(group)
        for state, m, v in zip(states, exp_avgs, exp_avg_sqs):
            for key, value in (("exp_avg", m), ("exp_avg_sq", v)):
                _store(state, key, quantize_state(value, group["group_size"], dtypes[key], group["expand"]))

    def _fused_update(
        self, group: dict[str, Any], params: Tensors, grads: Tensors, states: list[dict[str, Any]], steps: list[int]
    ) -> bool:
        """The compiled `kernels._coat_kernel` for parameters made of whole groups; a parameter
        with a padded last group takes the reference in the same step."""
        size = group["group_size"]
        rows = list(zip(params, grads, states, steps))
        whole = [row for row in rows if row[0].numel() % size == 0]
        padded = [row for row in rows if row[0].numel() % size]
        if not whole:
            return False
        beta1, beta2 = group["betas"]
        w_params, w_grads, w_states, w_steps = map(list, zip(*whole))
        done = compiled_coat_adamw(
            w_params, w_grads, [s.get("param_error") for s in w_states], w_states, w_steps, lr=group["lr"],
            beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], group_size=size,
            expand=group["expand"], fused=self.fused,
        )  # fmt: skip
        if done and padded:
            self._update_bucket(group, *map(list, zip(*padded)), None)
        return done
