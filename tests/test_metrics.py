"""Lost-arithmetic metrics (ALGORITHMS.md §1) on cases with known answers."""

from __future__ import annotations

import pytest
import torch

from hf_lowprec.metrics import edq, imprecision_percentage


def test_all_updates_lost_in_bf16() -> None:
    # 200 + 0.1 == 200 in BF16 (ALGORITHMS.md §0): every update is lost.
    before = torch.full((1000,), 200.0, dtype=torch.bfloat16)
    update = torch.full((1000,), 0.1)
    after = (before.float() + update).to(torch.bfloat16)
    assert imprecision_percentage(before, after, update) == 100.0
    value, ratio = edq(before, after, update)
    assert value == 0.0 and ratio == 0.0


def test_nothing_lost_in_fp32() -> None:
    before = torch.randn(1000, dtype=torch.float64)
    update = torch.randn(1000, dtype=torch.float64) * 1e-3
    after = before + update
    assert imprecision_percentage(before, after, update) == 0.0
    value, ratio = edq(before, after, update)
    # after − before differs from update by FP64 rounding only (relative 2^-52 of |θ|).
    assert value == pytest.approx(torch.linalg.vector_norm(update).item(), rel=1e-9)
    assert ratio == pytest.approx(1.0, rel=1e-9)


def test_known_edq_and_partial_loss() -> None:
    before = torch.zeros(4)
    update = torch.tensor([3.0, 4.0, 0.0, 0.0])
    after = torch.tensor([3.0, 0.0, 0.0, 1.0])
    # Element 1 lost its update; element 2 had none (not lost); element 3 moved unasked.
    assert imprecision_percentage(before, after, update) == 25.0
    value, ratio = edq(before, after, update)
    assert value == pytest.approx(9.0 / 5.0) and ratio == pytest.approx(9.0 / 25.0)


def test_lists_aggregate_over_all_elements() -> None:
    generator = torch.Generator().manual_seed(0)
    before = [torch.randn(s, generator=generator).bfloat16() for s in ((10, 3), (7,), (2, 2, 2))]
    update = [torch.randn(t.shape, generator=generator) * 10.0 ** -k for k, t in enumerate(before, start=1)]
    after = [(b.float() + u).bfloat16() for b, u in zip(before, update)]
    flat = [torch.cat([t.reshape(-1).double() for t in ts]) for ts in (before, after, update)]
    assert imprecision_percentage(before, after, update) == imprecision_percentage(*flat)
    assert edq(before, after, update) == pytest.approx(edq(*flat), rel=1e-12)
    lost = sum(int(((u != 0) & (a == b)).sum()) for b, a, u in zip(before, after, update))
    assert imprecision_percentage(before, after, update) == pytest.approx(100.0 * lost / 45)


def test_zero_intended_update_counts_as_nothing_lost() -> None:
    before = torch.ones(5)
    assert edq(before, before, torch.zeros(5)) == (0.0, 1.0)
    assert imprecision_percentage(before, before, torch.zeros(5)) == 0.0
    assert imprecision_percentage([], [], []) == 0.0


def test_mismatched_sizes_raise() -> None:
    with pytest.raises(ValueError, match="same number of elements"):
        edq(torch.zeros(3), torch.zeros(4), torch.zeros(3))
