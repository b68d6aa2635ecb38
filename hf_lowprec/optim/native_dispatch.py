"""The native CPU path of the dispatch: a composition declared to `optim.native` (by its formats'
and rule's `native_name` and options, its tensors by `adamw.Composition.stored_names`), and the
call. Which declarations and dtypes the kernels run is the C++ side's own list: `unsupported`
asks it, so `dispatch` can fall back to the compiled step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from . import native

__all__ = ["native_call", "unsupported"]

_DECLARED: dict = {}
_CHECKED: dict = {}


def _declaration(composition) -> native.Declaration | str:
    if composition not in _DECLARED:
        _DECLARED[composition] = native.declaration(composition.m, composition.v, composition.rule)
    return _DECLARED[composition]


def _named(composition, rows: Sequence) -> dict[str, list]:
    """The rows' tensors by the names the kernels read (param, grad, grad_scale, the stored ones)."""
    named = {"param": [r.tensors[0] for r in rows], "grad": [r.tensors[1] for r in rows]}
    named["grad_scale"] = [r.tensors[2] for r in rows]
    for k, name in enumerate(composition.stored_names()):
        named[name] = [r.tensors[3 + k] for r in rows]
    if composition.rule.needs_seed:
        named["seed"] = [r.seed.reshape(1).cpu() for r in rows]
    return named


def _scalars(rows: Sequence) -> torch.Tensor:
    return torch.stack([r.scalars for r in rows]).cpu()


def unsupported(composition, sample) -> str | None:
    """Why the native kernels cannot run `composition` on a row like `sample` (a `dispatch.ParamStep`), or None."""
    reason = native.native_unavailable()
    if reason is not None:
        return reason
    if sample.tensors[0].device.type != "cpu":
        return f"the native kernels are for CPU tensors, got {sample.tensors[0].device.type}"
    declared = _declaration(composition)
    if isinstance(declared, str):
        return declared
    # The answer depends on the composition and the dtypes only (the rows are staged contiguous
    # before the call): asked once per pair, not at every step.
    key = (composition, tuple(None if t is None else t.dtype for t in sample.tensors))
    if key not in _CHECKED:
        staged = dataclasses.replace(sample, tensors=[None if t is None else t.contiguous() for t in sample.tensors])
        _CHECKED[key] = native.check(declared, _named(composition, [staged]), _scalars([staged]))
    return _CHECKED[key]


def native_call(composition, rows: Sequence) -> Callable[[], None]:
    """The native call that steps every row of a bucket (rows already checked by `unsupported`)."""
    declared = _declaration(composition)
    named, scalars, flag = _named(composition, rows), _scalars(rows), rows[0].found_inf
    return lambda: native.step(declared, named, scalars, found_inf=flag)
