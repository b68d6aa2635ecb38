"""Lost-arithmetic metrics of an optimizer step (Collage §3, docs/algorithms.md §1).

For a parameter θ with intended update Δθ and the value θ̂ it actually holds after the step,
the effective update is Δθ̂ = θ̂ − θ, computed exactly in FP64. Everything here is computed
in FP64 from copies, so measuring never changes the training trajectory.

Each function takes one tensor per argument or equally long lists of tensors; a list is
aggregated over all its elements (a parameter group or a whole model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["edq", "imprecision_percentage", "step_metrics"]

Tensors = torch.Tensor | Sequence[torch.Tensor]


def _flat64(tensors: Tensors) -> torch.Tensor:
    if torch.is_tensor(tensors):
        return tensors.detach().reshape(-1).double()
    if len(tensors) == 0:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _check(before: torch.Tensor, after: torch.Tensor, update: torch.Tensor) -> None:
    if not before.numel() == after.numel() == update.numel():
        raise ValueError(
            f"before, after and update must hold the same number of elements, got "
            f"{before.numel()}, {after.numel()} and {update.numel()}; pass the same parameters "
            f"in the same order to each argument"
        )


def imprecision_percentage(before: Tensors, after: Tensors, update: Tensors) -> float:
    """Share of elements, in percent, whose non-zero intended update was lost entirely.

    100 × |{i : Δθ_i ≠ 0 and θ̂_i == θ_i}| / numel (Collage §3.2). With lists the count and
    the number of elements are totals over all tensors. Returns 0.0 for empty input.

    Args:
        before: parameter values before the step (any dtype; an expansion may be passed as
            its FP64 sum hi + lo).
        after: parameter values after the step.
        update: the intended update Δθ.
    """
    b, a, u = _flat64(before), _flat64(after), _flat64(update)
    _check(b, a, u)
    if b.numel() == 0:
        return 0.0
    lost = (u != 0) & (a == b)
    return 100.0 * lost.sum().item() / b.numel()


def edq(before: Tensors, after: Tensors, update: Tensors) -> tuple[float, float]:
    """Effective descent quality ⟨Δθ/‖Δθ‖, Δθ̂⟩ and its ratio to ‖Δθ‖ (Collage §3.2).

    Δθ̂ = after − before in FP64. Without lost arithmetic EDQ = ‖Δθ‖ and the ratio is 1.0;
    the ratio is comparable across steps and models. With lists the vectors are the
    concatenation of all tensors.

    When nothing was intended (‖Δθ‖ = 0) the direction is undefined: EDQ is reported as 0.0
    and the ratio as 1.0, meaning "nothing was lost".

    Returns:
        (edq, edq / ‖Δθ‖).
    """
    b, a, u = _flat64(before), _flat64(after), _flat64(update)
    _check(b, a, u)
    norm = torch.linalg.vector_norm(u).item()
    if norm == 0.0:
        return 0.0, 1.0
    value = torch.dot(u, a - b).item() / norm
    return value, value / norm


def step_metrics(records: Sequence[Any], group_count: int) -> dict[str, float]:
    """The logged metrics of one measured step, under `precision/...` keys.

    `records` hold, per parameter, `group` (its parameter-group index) and `before`, `after`
    and `update`: the values the optimizer holds (θ + δθ, masters), not the visible
    parameters. Imprecision % and EDQ over all of them, and per group where there are several.
    """
    per_group: dict[int, list] = {}
    for r in records:
        per_group.setdefault(r.group, []).append(r)
    out: dict[str, float] = {}
    for name, recs in [("", list(records))] + [(f"/group{g}", per_group[g]) for g in sorted(per_group)]:
        if group_count == 1 and name:
            continue
        before = [r.before for r in recs]
        after = [r.after for r in recs]
        update = [r.update for r in recs]
        out[f"precision/imprecision_pct{name}"] = imprecision_percentage(before, after, update)
        quality, ratio = edq(before, after, update)
        out[f"precision/edq{name}"] = quality
        out[f"precision/edq_ratio{name}"] = ratio
    return out
