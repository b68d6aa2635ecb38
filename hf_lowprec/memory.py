"""Model-state memory: counted from live tensor storage (`model_state_bytes`), or planned from the
optimizer's own state initialisers (`plan_model_state`), which also works on the meta device (the
`hf-lowprec memory` command plans a 7B model that way)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "ADOPTED_ATTR",
    "KEPT_FP32_ATTR",
    "describe_dtypes",
    "elements_by_dtype",
    "gradient_holders",
    "kept_in_fp32",
    "model_state_bytes",
    "plan_model_state",
    "planned_states",
    "state_dtypes",
    "trainable_parameters",
    "unwrap_optimizer",
    "zero_per_rank",
]

# On a model: {dtype: elements} of the 16-bit parameters a strategy made FP32 as it adopted the
# model (`strategies/adopt.py`, 2 bytes more each); the startup report lists them.
ADOPTED_ATTR = "hf_lowprec_adopted_dtypes"

# On a parameter the cast kept FP32 as transformers loads it (`strategies.casting.kept_parameters`), so
# the promise checks (`report`, `strategies.prepared`) allow its dtype.
KEPT_FP32_ATTR = "hf_lowprec_kept_fp32"


def kept_in_fp32(param: torch.Tensor) -> bool:
    """Whether `param` is an FP32 parameter a 16-bit strategy's cast kept FP32 (`KEPT_FP32_ATTR`)."""
    return param.dtype == torch.float32 and getattr(param, KEPT_FP32_ATTR, False)


# State keys of optimizers that do not declare `state_roles` (e.g. torch.optim.AdamW).
DEFAULT_STATE_ROLES = {
    "exp_avg": "optimizer",
    "exp_avg_sq": "optimizer",
    "momentum_buffer": "optimizer",
    "max_exp_avg_sq": "optimizer",
    "step": "extra",
}
# Where each role's bytes are counted by `plan_model_state`.
_BUCKETS = {"optimizer": "optimizer_states", "gradient": "grads"}


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer under Accelerate's and the strategy's wrappers."""
    while hasattr(optimizer, "optimizer") and not isinstance(optimizer.optimizer, str):
        optimizer = optimizer.optimizer
    return optimizer


class _Coverage:
    """Bytes of storage covered by tensors, each byte counted once across all calls.

    A tensor covers the byte range of its storage from its first to its last element
    (views of one flat buffer cover disjoint ranges; a slice covers only its rows; tied
    weights cover the same range once).
    """

    def __init__(self) -> None:
        self._ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}

    def claim(self, t: torch.Tensor) -> int:
        """Bytes of `t` not covered by an earlier call."""
        if t.numel() == 0:
            return 0
        size = t.element_size()
        start = t.storage_offset() * size
        extent = 1 + sum((n - 1) * abs(stride) for n, stride in zip(t.shape, t.stride()))
        end = start + extent * size
        pointer = t.untyped_storage().data_ptr()
        if pointer == 0:  # no storage to share (e.g. a meta tensor)
            return end - start
        ranges = self._ranges.setdefault((str(t.device), pointer), [])
        index = bisect.bisect_left(ranges, (start, start))
        first = index - 1 if index > 0 and ranges[index - 1][1] >= start else index
        last = first
        covered = 0
        new_start, new_end = start, end
        while last < len(ranges) and ranges[last][0] <= end:
            lo, hi = ranges[last]
            covered += max(0, min(hi, end) - max(lo, start))
            new_start, new_end = min(new_start, lo), max(new_end, hi)
            last += 1
        ranges[first:last] = [(new_start, new_end)]
        return (end - start) - covered


def model_state_bytes(model: torch.nn.Module, optimizer: Any | None = None) -> dict[str, float]:
    """Bytes per trainable parameter held by parameters, gradients, optimizer states and extras.

    Parameters are counted by their number of elements; memory by the storage bytes the
    tensors cover, each byte once (tied weights, parameters that are views of one flat
    buffer, ZeRO partitions; a slice counts its own rows, not the whole buffer). Gradients
    are counted from `p.grad` when present, otherwise as one element of the parameter's
    dtype (what backward will allocate), plus any optimizer state whose role is "gradient"
    (e.g. FP8 gradients kept by the optimizer instead of `p.grad`). Extras are MCF error
    components, master weights, scales and step counters.

    Returns:
        dict with keys "params", "grads", "optimizer_states", "extra", "total" (bytes per
        parameter) and "num_params".
    """
    coverage = _Coverage()
    trainable = [p for p in model.parameters() if p.requires_grad]
    totals = {"params": 0, "grads": 0, "optimizer_states": 0, "extra": 0}
    num_params = 0
    for p in trainable:
        covered = coverage.claim(p)
        totals["params"] += covered
        # Two parameter objects over the same elements are one parameter.
        num_params += covered // p.element_size() if covered < p.numel() * p.element_size() else p.numel()
    if num_params == 0:
        raise ValueError("the model has no trainable parameters")

    inner = unwrap_optimizer(optimizer) if optimizer is not None else None
    roles = dict(DEFAULT_STATE_ROLES)
    roles.update(getattr(inner, "state_roles", {}) or {})
    grad_in_state: set[int] = set()
    if inner is not None:
        for param, state in inner.state.items():
            for key, value in state.items():
                if not torch.is_tensor(value):
                    continue
                role = roles.get(key, "extra")
                bucket = {"optimizer": "optimizer_states", "gradient": "grads"}.get(role, "extra")
                totals[bucket] += coverage.claim(value)
                if role == "gradient":
                    grad_in_state.add(id(param))
    for p in trainable:
        if p.grad is not None:
            totals["grads"] += coverage.claim(p.grad)
        elif id(p) not in grad_in_state:
            totals["grads"] += p.numel() * p.element_size()
    out = {k: v / num_params for k, v in totals.items()}
    out["total"] = sum(out.values())
    out["num_params"] = float(num_params)
    return out


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    unique: dict[int, torch.nn.Parameter] = {}
    for p in model.parameters():
        if p.requires_grad:
            unique.setdefault(id(p), p)
    return list(unique.values())


def plan_model_state(model: torch.nn.Module, optimizer: Any) -> dict[str, float]:
    """Model-state bytes per trainable parameter, from the optimizer's state as it is or will be.

    Parameters without state yet get the state the optimizer's `plan_state` would create
    (torch optimizers without one: two moments in the parameter dtype). A gradient counts in
    the dtype the optimizer's `planned_grad_dtype(param)` names (an optimizer that keeps FP8
    gradients in its state), else in the parameter dtype. Every tensor is counted by numel ×
    element size, so this works on the meta device; tied parameters count once. An FP8 gradient
    handed over to the optimizer's state adds its FP32 scale (4 B) to "extra".

    Returns:
        dict with "params", "grads", "optimizer_states", "extra", "total" (bytes/param) and
        "num_params".
    """
    inner = unwrap_optimizer(optimizer)
    roles = {**DEFAULT_STATE_ROLES, **(getattr(inner, "state_roles", {}) or {})}
    planned_grad_dtype = getattr(inner, "planned_grad_dtype", None)
    params = trainable_parameters(model)
    num_params = sum(p.numel() for p in params)
    if num_params == 0:
        raise ValueError("the model has no trainable parameters")
    totals = dict.fromkeys(("params", "grads", "optimizer_states", "extra"), 0.0)
    for p, state in planned_states(inner, params):
        for key, value in state.items():
            if torch.is_tensor(value):
                bucket = _BUCKETS.get(roles.get(key, "extra"), "extra")
                totals[bucket] += value.numel() * value.element_size()
        if not any(roles.get(k) == "gradient" for k in state):  # else counted above
            holder, dtype = _gradient_holder(p, state, roles, planned_grad_dtype)
            size = torch.empty((), dtype=dtype, device="meta").element_size()
            totals["grads"] += p.numel() * size
            if holder != "p.grad" and size == 1:  # an FP8 gradient handed over keeps its FP32 scale beside it
                totals["extra"] += 4
    for p in params:
        totals["params"] += p.numel() * p.element_size()
    out = {k: v / num_params for k, v in totals.items()}
    out["total"] = sum(out.values())
    out["num_params"] = float(num_params)
    return out


def planned_states(inner: Any, params: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
    """(parameter, its optimizer state as it is or will be) for each of `params` the optimizer
    `inner` holds: without state yet, what its `plan_state` would create (torch optimizers
    without one: two moments in the parameter dtype and an FP32 step count, on meta); a step count
    still a host int is the 0-dim FP64 tensor the first step makes it (`optim.skipping`)."""
    owned = {id(p) for p in params}
    init_state = getattr(inner, "plan_state", None)
    grouped = [(p, group) for group in inner.param_groups for p in group["params"] if id(p) in owned]
    # Parameters an optimizer keeps outside its groups (the FP8 weights ZeRO's FP8 AdamW distributes
    # whole, its `fp8_params`) are planned by its `plan_state(param)`; others are another optimizer's.
    seen = {id(p) for p, _ in grouped}
    outside = {id(p) for p in getattr(inner, "fp8_params", ())}
    grouped += [(p, None) for p in params if id(p) not in seen and id(p) in outside and init_state is not None]
    for p, group in grouped:
        state = inner.state.get(p) or None
        if state is None:
            if group is None:
                state = inner.plan_state(p)
            elif init_state is not None:
                state = init_state(p, group)
            else:  # torch.optim.AdamW: its count a 0-dim FP32 tensor
                state = {
                    "step": torch.empty((), device="meta"),
                    "exp_avg": torch.empty_like(p, device="meta"),
                    "exp_avg_sq": torch.empty_like(p, device="meta"),
                }
        if "step" in state and not torch.is_tensor(state["step"]) and state["step"] == 0:  # a strategy's step does
            state = {**state, "step": torch.empty((), dtype=torch.float64, device="meta")}
        yield p, state


def _gradient_holder(
    p: torch.Tensor, state: dict[str, Any], roles: dict[str, str], planned_grad_dtype: Any
) -> tuple[str, torch.dtype]:
    gradient_keys = [k for k, r in roles.items() if r == "gradient"]
    held = next((state[k] for k in gradient_keys if torch.is_tensor(state.get(k))), None)
    if held is not None:
        return f"optimizer state {gradient_keys[0]!r}", held.dtype
    dtype = planned_grad_dtype(p) if planned_grad_dtype is not None else p.dtype
    if dtype != p.dtype and gradient_keys:  # handed over to the optimizer's state, `p.grad` freed
        return f"optimizer state {gradient_keys[0]!r}", dtype
    return "p.grad", dtype


def gradient_holders(inner: Any, params: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, str, torch.dtype]]:
    """(parameter, where its gradient is held for the step, its dtype) for each of `params` the
    optimizer `inner` holds, as `plan_model_state` counts it: a state of role "gradient" (as it is
    or will be, `planned_states`), else the dtype of the optimizer's `planned_grad_dtype(param)`
    (in that state when it differs from the parameter's), else `p.grad` in the parameter dtype."""
    roles = {**DEFAULT_STATE_ROLES, **(getattr(inner, "state_roles", {}) or {})}
    planned_grad_dtype = getattr(inner, "planned_grad_dtype", None)
    for p, state in planned_states(inner, params):
        yield (p, *_gradient_holder(p, state, roles, planned_grad_dtype))


def state_dtypes(inner: Any, params: list[torch.Tensor]) -> dict[str, dict[str, int]]:
    """{state name: {dtype name: elements}} over the optimizer state of every one of `params`, as
    it is or will be (`planned_states`); 0-dim states (step counts, scales) left out."""
    out: dict[str, dict[str, int]] = {}
    for _, state in planned_states(inner, params):
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                counts = out.setdefault(key, {})
                name = str(value.dtype).removeprefix("torch.")
                counts[name] = counts.get(name, 0) + value.numel()
    return out


def elements_by_dtype(tensors: Any) -> dict[torch.dtype, int]:
    """{dtype: elements} over `tensors`, the dtype holding most first: the trainable parameters'
    dtypes as the startup report and a recipe's result both count them."""
    counts: dict[torch.dtype, int] = {}
    for t in tensors:
        counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def describe_dtypes(counts: dict[str, int]) -> str:
    """`state_dtypes`' counts of one state as text: "float32", or "float8_e4m3fn 57% / float32 43%"."""
    total = sum(counts.values())
    return " / ".join(
        f"{d} {n / total:.0%}" if len(counts) > 1 else d for d, n in sorted(counts.items(), key=lambda kv: -kv[1])
    )


def zero_per_rank(plan: dict[str, float], world_size: int, stage: int) -> dict[str, float]:
    """Per-rank bytes/param (of the whole model's parameter count) under ZeRO `stage` on `world_size` ranks.

    Stage 1 partitions optimizer states and extra components (masters, MCF components),
    stage 2 also gradients, stage 3 also parameters. Stages 1 and 2 keep every rank's whole
    model and, beside it, the rank's flat partition of the weights in the parameters' dtype
    (DeepSpeed's `single_partition_of_fp32_groups`, BF16 under the BF16-weight strategies),
    which the optimizer steps: `weight_partition`, params / world_size.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    split = {"optimizer_states": stage >= 1, "extra": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    out = {k: plan[k] / (world_size if split[k] else 1) for k in split}
    out["weight_partition"] = plan["params"] / world_size if stage in (1, 2) else 0.0
    out["total"] = sum(out.values())
    out["num_params"] = plan["num_params"]
    return out
