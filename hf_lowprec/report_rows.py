"""The startup report's module rows and gradient facts (`report.describe`), read from the live objects.

A module row counts each parameter once, at its first owner (a tied LM head names the embedding
it shares), and its compute is what the strategy's forward context really does to the module's
operation (`compute_label`: under autocast, a matmul in the low dtype, an embedding lookup or a
LayerNorm in FP32). The gradients are counted where they are held for the step
(`memory.gradient_holders`, as the memory figures count them).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .memory import describe_dtypes, gradient_holders

__all__ = ["compute_label", "module_rows", "gradient_facts", "gradient_text"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _operation(module: nn.Module, dtype: torch.dtype, device: torch.device) -> tuple[str, Callable] | None:
    """(kind, the module's operation on tiny fresh tensors of its parameter dtype), or None for a
    module whose operation is not known here. Fresh tensors: no hook of the module runs."""

    def ones(*shape: int) -> torch.Tensor:
        return torch.ones(*shape, dtype=dtype, device=device)

    if isinstance(module, nn.Embedding):
        return "embedding", lambda: F.embedding(torch.zeros(1, dtype=torch.long, device=device), ones(2, 2))
    if isinstance(module, nn.LayerNorm):
        return "layer_norm", lambda: F.layer_norm(ones(1, 2), (2,), ones(2), ones(2))
    if isinstance(module, nn.GroupNorm):
        return "group_norm", lambda: F.group_norm(ones(1, 2), 1, ones(2), ones(2))
    if isinstance(module, nn.Linear):
        return "linear", lambda: F.linear(ones(1, 2), ones(2, 2), ones(2))
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        n = len(module.kernel_size)
        conv = (F.conv1d, F.conv2d, F.conv3d)[n - 1]
        return f"conv{n}d", lambda: conv(ones(1, 1, *[1] * n), ones(1, 1, *[1] * n))
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:  # transformers' GPT-2 linear
        return "addmm", lambda: torch.addmm(ones(2), ones(1, 2), ones(2, 2))
    return None


def compute_label(
    strategy: Any, module: nn.Module, autocast: torch.dtype | None = None, seen: dict | None = None
) -> str:
    """What `module` computes in under `strategy`: its FP8 GEMM, or, under the strategy's
    autocast (`autocast`: its dtype), the dtype its operation comes out in there, run once per
    kind on tiny tensors (`seen` caches them); else the strategy's compute dtype."""
    from .fp8 import FP8Linear
    from .fp8.experts import FP8Experts

    if isinstance(module, FP8Linear):  # output gradients: E5M2 under tensorwise, E4M3 under the finer recipes
        if module.config.raised:
            return "BF16 GEMM (raised by the guard)"
        grad = "e5m2" if module.config.recipe.grad_dtype == torch.float8_e5m2 else "e4m3"
        return f"fp8 GEMM {module.recipe} (e4m3 fwd, {grad} grad)"
    if isinstance(module, FP8Experts):
        grad = "e5m2" if module.fp8_layer_config.recipe.grad_dtype == torch.float8_e5m2 else "e4m3"
        return f"fp8 grouped GEMM {module.fp8_recipe} per expert (e4m3 fwd, {grad} grad)"
    if autocast is None:
        return _dtype_name(strategy.compute_dtype)
    param = next(module.parameters(recurse=False))
    device = param.device if param.device.type in ("cpu", "cuda") else torch.device("cpu")
    operation = _operation(module, param.dtype, device)
    if operation is None:
        return f"per operation under {_dtype_name(autocast)} autocast"
    key = (operation[0], param.dtype, device)
    seen = {} if seen is None else seen
    if key not in seen:
        with torch.no_grad(), strategy.forward_context():
            seen[key] = operation[1]().dtype
    return f"{_dtype_name(seen[key])} (autocast)"


def _autocast_dtype(strategy: Any, model: nn.Module) -> torch.dtype | None:
    """The dtype of the autocast the strategy's forward context turns on for the model's device."""
    param = next(model.parameters(), None)
    device = param.device.type if param is not None and param.device.type in ("cpu", "cuda") else "cpu"
    with strategy.forward_context():
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def module_rows(strategy: Any, model: nn.Module) -> list[dict[str, Any]]:
    """Per module type: count, parameter dtypes, compute, trainable parameters (each counted once,
    at its first owner) and, where the type shares parameters with another module, which
    (`tied`: "lm_head.weight = transformer.wte.weight")."""
    autocast = _autocast_dtype(strategy, model)
    seen: dict = {}
    owner: dict[int, str] = {}
    modules: dict[str, dict[str, Any]] = collections.OrderedDict()
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        entry = modules.setdefault(
            type(module).__name__,
            {"count": 0, "param_dtypes": set(), "compute": set(), "trainable": 0, "tied": []},
        )
        entry["count"] += 1
        entry["param_dtypes"].update(_dtype_name(p.dtype) for _, p in own)
        entry["compute"].add(compute_label(strategy, module, autocast, seen))
        for short, p in own:
            full = f"{name}.{short}" if name else short
            if id(p) in owner:
                entry["tied"].append(f"{full} = {owner[id(p)]}")
                continue
            owner[id(p)] = full
            entry["trainable"] += p.numel() if p.requires_grad else 0
    return [
        {
            "type": t,
            "count": e["count"],
            "param_dtypes": sorted(e["param_dtypes"]),
            "compute": sorted(e["compute"]),
            "trainable_params": e["trainable"],
            **({"tied": e["tied"]} if e["tied"] else {}),
        }
        for t, e in modules.items()
    ]


def gradient_facts(strategy: Any, inner: Any, params: list[torch.Tensor]) -> dict[str, Any]:
    """Where the gradients of `params` are held for the optimizer `inner`'s step and in which
    dtype, in elements, and which of them the strategy quantizes to FP8 each step (its optional
    `gradient_format(param)`: FP8-LM) though held wider."""
    held: dict[str, dict[str, int]] = {}
    quantized: dict[str, int] = {}
    fmt_of = getattr(strategy, "gradient_format", None)
    for p, where, dtype in gradient_holders(inner, params):
        fmt = fmt_of(p) if fmt_of is not None else None
        if fmt is not None and where != "p.grad" and dtype.itemsize == fmt.itemsize:
            dtype = fmt  # the format handed over (a plan names the optimizer's default)
        counts = held.setdefault(where, {})
        counts[_dtype_name(dtype)] = counts.get(_dtype_name(dtype), 0) + p.numel()
        if fmt is not None and fmt != dtype:
            quantized[_dtype_name(fmt)] = quantized.get(_dtype_name(fmt), 0) + p.numel()
    dtypes: dict[str, int] = {}
    for counts in held.values():
        for name, n in counts.items():
            dtypes[name] = dtypes.get(name, 0) + n
    out: dict[str, Any] = {"dtype": describe_dtypes(dtypes) if dtypes else "none", "dtypes": dtypes, "held": held}
    if quantized:
        out["rounded_to_fp8"] = quantized
    return out


def gradient_text(grads: dict[str, Any]) -> str:
    """`gradient_facts` (or a report without them: the dtype alone) as one phrase for the log."""
    if "held" not in grads:
        return grads["dtype"] if isinstance(grads["dtype"], str) else "/".join(grads["dtype"])
    parts = [
        f"{name} in {where} ({n:,})" for where, counts in grads["held"].items() for name, n in sorted(counts.items())
    ]
    rounded = grads.get("rounded_to_fp8", {})
    parts += [f"{n:,} of them rounded to {name} each step" for name, n in rounded.items()]
    return ", ".join(parts)
