"""The native FP8 grouped GEMM path of the experts (`torch._scaled_grouped_mm`, SM90), on CPU.

A CPU-only torch has no kernel for `torch._scaled_grouped_mm`, but it has the kernel's argument
checks (torch's meta function for it: dtypes, row-/column-major operands, 16-byte strides, scale
shapes) and a BF16 `torch._grouped_mm`. So the native path runs here against a stand-in that
first applies those checks to meta copies of its arguments, then computes what the kernel
computes: the E4M3 payloads times their scales (which multiply: 1/s in the package's
convention), products summed in FP32, rounded once to BF16. The native path must then give
bit for bit what the emulation gives: the same exact operands, the same sums (its padding rows
are zeros), and an expert without tokens must still get a zero gradient.
"""

from __future__ import annotations

import pytest
import torch

from hf_lowprec.fp8 import grouped
from hf_lowprec.fp8.cast import widen
from hf_lowprec.fp8.scaling_recipes import scaling_recipe


def _meta(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


CALLS: list[str] = []


def _stand_in(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    CALLS.append("2d-3d" if b.dim() == 3 else "2d-2d")
    # The kernel's own argument checks (raise on a layout or shape it refuses).
    torch.ops.aten._scaled_grouped_mm(
        _meta(a), _meta(b), _meta(scale_a), _meta(scale_b), _meta(offs), None, None, out_dtype, use_fast_accum
    )
    assert out_dtype == torch.bfloat16 and not use_fast_accum
    groups = offs.shape[0]
    if b.dim() == 3:  # 2d × 3d: scale_a per row of a, scale_b per (group, output column)
        a_real = widen(a, torch.float32) * scale_a[:, None]
        b_real = widen(b, torch.float32) * scale_b[:, None, :]
        return torch._grouped_mm(a_real.bfloat16(), b_real.bfloat16(), offs=offs)
    # 2d × 2d, groups along the contraction: scale_a per (group, row of a), scale_b per (group, column of b)
    n, k = a.shape[0], b.shape[1]
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    group_of = torch.searchsorted(ends, torch.arange(a.shape[1]), right=True).clamp(max=groups - 1)
    inside = torch.arange(a.shape[1]) < ends[-1]
    sa = scale_a.reshape(groups, n)[group_of].t() * inside  # n × M
    sb = scale_b.reshape(groups, k)[group_of] * inside[:, None]  # M × k
    assert (starts <= ends).all()
    a_real = widen(a, torch.float32) * sa
    b_real = widen(b, torch.float32) * sb
    return torch._grouped_mm(a_real.bfloat16(), b_real.bfloat16(), offs=offs)


def _run(recipe: str, native: bool, counts: list[int], transposed: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    experts, n, k = len(counts), 48, 32
    tokens = sum(counts)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    rows = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    x = torch.randn(tokens, k, generator=g).requires_grad_()
    w = torch.randn(experts, n, k, generator=g) * 0.2
    if transposed:
        w = w.transpose(1, 2).contiguous()
    w.requires_grad_()
    dy = torch.randn(tokens, n, generator=g)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grouped, "_use_native", lambda config, device: native and config.recipe.native_grouped)
        patch.setattr(torch, "_scaled_grouped_mm", _stand_in, raising=False)
        y = grouped.fp8_grouped_linear(x, w, offsets, rows, recipe=recipe, transposed=transposed)
        y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("counts", [[5, 0, 19, 1], [16, 32, 0, 48], [0, 0, 37, 0]])
def test_native_path_matches_the_emulation_bit_for_bit(recipe, counts):
    emulated = _run(recipe, False, counts)
    CALLS.clear()
    native = _run(recipe, True, counts)
    # Forward natively under both; the backward's dx and dW only under rowwise (E5M2 gradients
    # of tensorwise are not E4M3, which the kernel requires).
    expected = ["2d-3d", "2d-3d", "2d-2d"] if recipe == "rowwise" else ["2d-3d"]
    assert expected == CALLS
    for name, a, b in zip(("y", "dx", "dW"), emulated, native):
        assert torch.equal(a, b), f"{recipe} {counts}: native {name} differs from the emulation"
    empty = [e for e, c in enumerate(counts) if c == 0]
    assert torch.isfinite(native[2]).all() and (native[2][empty] == 0).all()


def test_native_path_takes_the_transposed_expert_layout():
    for recipe in ("tensorwise", "rowwise"):
        emulated = _run(recipe, False, [7, 9, 0, 13], transposed=True)
        native = _run(recipe, True, [7, 9, 0, 13], transposed=True)
        assert all(torch.equal(a, b) for a, b in zip(emulated, native))


def test_padded_layout_starts_every_expert_on_a_multiple_of_16():
    counts = torch.tensor([5, 0, 19, 16, 1])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    rows = torch.repeat_interleave(torch.arange(5), counts)
    dest, padded, total = grouped.padded_layout(offsets, rows)
    assert padded.tolist() == [16, 16, 48, 64, 80] and padded.dtype == torch.int32
    assert total >= 80 and total % 16 == 0 and total == -(-(41 + 5 * 15) // 16) * 16  # static: S + 15·E
    assert dest.tolist() == [*range(5), *range(16, 35), *range(48, 64), 64]
    assert len(set(dest.tolist())) == len(dest)


def test_the_kernel_checks_refuse_a_wrong_layout():
    """The stand-in's checks can fail: a row-major B is refused, as on the GPU."""
    a = torch.zeros(32, 16, dtype=torch.float8_e4m3fn)
    b = torch.zeros(2, 16, 32, dtype=torch.float8_e4m3fn)  # row-major: the kernel wants column-major
    with pytest.raises(RuntimeError, match="column major"):
        _stand_in(
            a,
            b,
            torch.ones(32),
            torch.ones(2, 32),
            offs=torch.tensor([16, 32], dtype=torch.int32),
            out_dtype=torch.bfloat16,
        )


def test_native_grouped_is_chosen_on_hopper_only():
    assert not grouped.native_grouped(scaling_recipe("rowwise"), torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "_scaled_grouped_mm", _stand_in, raising=False)
        patch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        chosen = {
            name: grouped.native_grouped(scaling_recipe(name), cuda)
            for name in ("tensorwise", "rowwise", "blockwise", "mxfp8")
        }
        assert chosen == {"tensorwise": True, "rowwise": True, "blockwise": False, "mxfp8": False}
        for capability in ((8, 9), (10, 0)):
            patch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
            assert not grouped.native_grouped(scaling_recipe("rowwise"), cuda)
