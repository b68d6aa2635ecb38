"""What one ATen operation costs a GPU, read from its call: whether it launches a kernel (not a
view, an allocation or a metadata read), how many launches a multi-tensor operation splits into,
a GEMM's or attention's FLOPs, the tensors it reads and writes and their bytes. The step ledger
(`ledger`) adds these up per phase.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "gemm_flops",
    "launches_a_kernel",
    "multi_tensor_launches",
    "nbytes",
    "tensors_in",
    "written_arguments",
]

aten = torch.ops.aten
# Operations that allocate or only read metadata: no kernel runs (a view, whose output aliases
# its input without writing it, is recognised from its schema).
_NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.lift_fresh.default,
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten.is_same_size.default,
    aten._local_scalar_dense.default,  # a host sync, no kernel
    aten._unsafe_view.default,  # a view whose schema does not say so (after `reshape`'s copy)
}
_ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm"}


def launches_a_kernel(func: Any) -> bool:
    """Whether an ATen operation runs a kernel on a GPU (not a view, an allocation or a metadata read)."""
    if func in _NO_KERNEL or func.namespace in ("profiler", "prim"):  # markers, `prim::device`
        return False
    returns = func._schema.returns
    # A view: every output aliases an input and nothing is written.
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))


def _argument(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """The argument `name` of a call of `func`, read from its schema (positional or keyword)."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[position] if position < len(args) else kwargs.get(name, default)
    return default


def gemm_flops(func: Any, name: str, args: tuple, kwargs: dict) -> tuple[int, torch.dtype] | None:
    """(FLOPs, operand dtype) of a GEMM or attention operation, None for any other."""
    if name in _GEMMS:
        a = args[1] if name in ("addmm", "baddbmm") else args[0]
        b = args[2] if name in ("addmm", "baddbmm") else args[1]
        # Every row of a (groups stacked or not) meets one K×N matrix of b: 2·rows·K·N.
        return 2 * (a.numel() // a.shape[-1]) * a.shape[-1] * b.shape[-1], a.dtype
    if any(name.startswith(p) for p in _ATTENTION):
        q, k = _argument(func, args, kwargs, "query"), _argument(func, args, kwargs, "key")
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or not isinstance(k, torch.Tensor):
            return None
        batch, heads, rows, dim = q.shape
        # Causal attention (what a decoder trains): the fused kernels skip the masked half.
        causal = 0.5 if _argument(func, args, kwargs, "is_causal", False) is True else 1.0
        flops = 4 * batch * heads * rows * k.shape[-2] * dim * causal
        return int(flops * (2.5 if name.endswith("backward") else 1.0)), q.dtype
    return None


# torch's multi-tensor kernels (`_foreach_*`, the fused optimizers) launch one kernel per chunk:
# at most 110, 64, 48, 36 or 30 tensors when they walk 1 to 5 lists at once, and at most 320
# blocks of 65536 elements (`MultiTensorApply.cuh`).
_TENSORS_PER_LAUNCH, _ELEMENTS_PER_LAUNCH = (110, 64, 48, 36, 30), 320 * 65536


def multi_tensor_launches(name: str, args: tuple) -> int:
    if not name.startswith(("_foreach_", "_fused_")):
        return 1
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    # A list of 0-dim tensors (a fused optimizer's step counts) rides along as kernel arguments.
    lists = [a for a in lists if a[0].dim() > 0] or lists[:1]
    if not lists:
        return 1
    per_launch = _TENSORS_PER_LAUNCH[min(len(lists), len(_TENSORS_PER_LAUNCH)) - 1]
    elements = sum(t.numel() for t in lists[0])
    return max(1, -(-len(lists[0]) // per_launch), -(-elements // _ELEMENTS_PER_LAUNCH))


def tensors_in(values: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found += [t for t in v if isinstance(t, torch.Tensor)]
    return found


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size() if t.layout == torch.strided else 0


def written_arguments(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operation writes in place (its schema's `Tensor(a!)` arguments)."""
    found: list[torch.Tensor] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        found += tensors_in([value])
    return found
