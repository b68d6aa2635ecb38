"""The step ledger's counts (issue #66, item 1; docs/planning.md): exact on operations whose
kernels, bytes and FLOPs follow from their shapes, and on whole steps of a tiny Llama."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_lowprec.compiling import compiled_region, constant
from hf_lowprec.optim.adamw import Composition
from hf_lowprec.optim.formats import Scaled
from hf_lowprec.optim.rules import ScaledMaster
from hf_lowprec.planning.counting import ANCHOR, count_scaled, count_step
from hf_lowprec.planning.ledger import Ledger
from tests.helpers import CHUNK_ROUNDING
from tests.helpers import TINY_LLAMA as TINY

F32 = 4


def _counted(fn):
    with FakeTensorMode(allow_non_fake_inputs=True):
        with Ledger() as ledger, ledger.phase("forward"):
            kept = fn()
        return ledger.counts()["forward"], ledger, kept


def test_an_eager_gemm_moves_its_operands_and_counts_2mkn_flops():
    m, k, n = 64, 32, 16

    def run():
        x, w = torch.empty(m, k), torch.empty(k, n)
        return x @ w

    counts, _, _ = _counted(run)
    assert counts.kernels == counts.eager == 1
    assert counts.flops[torch.float32] == 2 * m * k * n
    assert counts.bytes == (m * k + k * n + m * n) * F32


def test_a_compiled_call_fuses_pointwise_work_and_keeps_intermediates_on_chip():
    def run():
        x = torch.empty(1000)
        with compiled_region("cast"):
            y = (x * 2 + 1).abs()  # three pointwise operations: one kernel
            top = y.amax()  # a reduction joins it and ends it
            z = y / top  # a new kernel: reads y again, which the first wrote for it
        return z

    counts, _, _ = _counted(run)
    assert counts.graphs == 1 and counts.eager == 0
    assert counts.kernels == 2
    # Kernel 1 reads x and writes y (a later kernel of the call reads it? no: fused calls recompute;
    # it stays on chip) and amax's scalar; kernel 2 reads what it needs and writes z, which outlives.
    assert counts.bytes == 1000 * F32 + 1000 * F32


def test_sibling_reductions_share_a_kernel_and_what_reads_their_results_opens_one():
    """Inductor fuses by dependence, not by the order of the source: after amax(m) ends a kernel,
    amax(v) of the same call joins it when it reads nothing computed from amax(m), shares a
    tensor with that kernel and reduces as many elements; what reads either result is the next
    kernel (an optimizer row choosing its scales, then storing: `formats.Format.choose`)."""

    def run():
        g, m, v = torch.empty(1000), torch.empty(1000), torch.empty(1000)
        with compiled_region("row"):
            m2, v2 = m + g, v + g * g  # one kernel
            scale_m = 1.0 / m2.abs().amax()  # ends it; the reciprocal is its epilogue
            scale_v = 1.0 / v2.abs().amax()  # a sibling: the same kernel
            return m2 * scale_m, v2 * scale_v  # the second kernel

    counts, _, _ = _counted(run)
    assert counts.kernels == 2 and counts.graphs == 1
    # g, m and v read once, the two results written once: nothing in between leaves the chip.
    assert counts.bytes == 5 * 1000 * F32


@pytest.mark.parametrize("case", ["depends", "other size", "nothing shared"])
def test_a_reduction_that_is_no_sibling_ends_a_kernel_of_its_own(case):
    def run():
        x, y = torch.empty(1000), torch.empty(1000)
        with compiled_region("row"):
            top = (x * 2).amax()  # ends the first kernel
            if case == "depends":
                return (x / top).amax()  # reads the first reduction's result
            if case == "other size":
                return x[:500].abs().amax()  # shares x, reduces 500 elements
            return y.abs().amax()  # shares nothing with the first kernel

    counts, _, _ = _counted(run)
    assert counts.kernels == 2


def test_an_fp8_weights_update_is_two_kernels_its_three_scales_chosen_before_any_store():
    """FP8-LM O2's row (FP8 m, FP16 v, the FP16 master scaled): amax(m), amax(v) and amax(θ)
    are siblings, so one kernel chooses the three scales and one stores everything (issue #66:
    it was three kernels while each format chose and stored in turn)."""
    e4m3 = torch.float8_e4m3fn
    row = Composition(Scaled(e4m3), Scaled(torch.float16), ScaledMaster())

    def run():
        n = 4096
        param, grad = torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=e4m3)
        m, v = torch.empty(n, dtype=e4m3), torch.empty(n, dtype=torch.float16)
        scales = [torch.empty(()) for _ in range(4)]  # the gradient's, m's, v's, the master's
        with compiled_region("row"):
            row.step(param, grad, scales[0], m, scales[1], v, scales[2], scales[3], torch.empty(6), None)

    counts, _, _ = _counted(run)
    assert counts.kernels == 2 and counts.graphs == 1


def test_the_same_work_eager_writes_and_reads_every_intermediate():
    def run():
        x = torch.empty(1000)
        return (x * 2 + 1).abs()

    counts, _, _ = _counted(run)
    assert counts.kernels == counts.eager == 3
    assert counts.bytes == 3 * 2 * 1000 * F32


def test_a_gemm_inside_a_compiled_call_reads_its_operands_from_memory():
    def run():
        x, w = torch.empty(8, 16), torch.empty(16, 4)
        with compiled_region("layer"):
            y = (x * 2) @ w  # the scaled x is written for the GEMM, which reads it
        return y

    counts, _, _ = _counted(run)
    assert counts.kernels == 2
    assert counts.bytes == (8 * 16 * 2) * F32 + (8 * 16 + 16 * 4 + 8 * 4) * F32


def test_multi_tensor_operations_launch_one_kernel_per_chunk():
    def run():
        small = [torch.empty(10) for _ in range(250)]  # 250 tensors: three chunks of ≤ 110
        torch._foreach_mul_(small, 2.0)
        torch._foreach_add_(small, small)  # two lists: chunks of ≤ 64 tensors, four
        big = [torch.empty(320 * 65536 * 2 + 1)]  # one tensor over two chunks of elements
        torch._foreach_mul_(big, 2.0)

    counts, ledger, _ = _counted(run)
    assert counts.kernels == 3 + 4 + 3
    assert ledger.ops[("forward", "_foreach_mul_")] == 6


def test_a_value_read_on_the_host_is_a_sync_answered_with_a_stand_in():
    def run():
        return float(torch.empty(4).sum()), bool(torch.empty((), dtype=torch.bool))

    counts, _, kept = _counted(run)
    assert counts.syncs == 2
    assert kept == (1.0, True)


def test_a_grouped_gemm_off_bf16_is_counted_as_torch_runs_it_on_a_gpu():
    """FP32 (or FP16) operands take torch's per-group path: the offsets read on the host, one GEMM
    per group. BF16 ones take the grouped kernel: one launch, no sync."""
    groups, rows, k, n = 4, 64, 32, 16

    def run(dtype):
        def step():
            a, b = torch.empty(rows, k, dtype=dtype), torch.empty(groups, k, n, dtype=dtype)
            offsets = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
            return torch._grouped_mm(a, b, offs=offsets)

        return step

    wide, _, out = _counted(run(torch.float32))
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    assert wide.syncs == 1 and wide.kernels == groups
    assert wide.flops[torch.float32] == 2 * rows * k * n
    narrow, _, _ = _counted(run(torch.bfloat16))
    assert narrow.syncs == 0 and narrow.kernels == 1


@pytest.mark.parametrize("causal", [True, False])
def test_attention_counts_4bhs2d_forward_and_halves_what_a_causal_kernel_skips(causal):
    b, h, s, d = 2, 4, 32, 16

    def run():
        q = torch.empty(b, h, s, d, requires_grad=True)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=causal)
        out.sum().backward()

    counts, _, _ = _counted(run)
    forward = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    assert counts.flops[torch.float32] == int(forward) + int(2.5 * forward)


class _Scaled(torch.Tensor):
    """A wrapper tensor (as torchao's float8 tensors are): each operation on it runs the
    operation on its inner tensor, then one more (a scale), and wraps the result."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrapped = [a.inner if isinstance(a, _Scaled) else a for a in args]
        return _Scaled(func(*unwrapped, **(kwargs or {})) * 0.5)


def test_a_tensor_subclass_is_counted_by_the_operations_on_its_inner_tensors():
    """The subclass's own dispatch runs below the ledger: `x * 2 + 1` on it is two operations
    and two scales, four kernels (counted at the subclass's level it would be two)."""

    def run():
        return _Scaled(torch.empty(64, 32)) * 2 + 1

    counts, ledger, _ = _counted(run)
    assert counts.kernels == counts.eager == 4, ledger.ops
    assert ledger.ops == {("forward", "mul"): 3, ("forward", "add"): 1}


def test_a_constant_table_first_built_under_a_fake_mode_is_real():
    @constant
    def table(device: torch.device) -> torch.Tensor:
        return torch.arange(4, device=device) * 2

    with FakeTensorMode():
        inside = table(torch.device("cpu"))
    assert not isinstance(inside, torch._subclasses.fake_tensor.FakeTensor)
    assert table(torch.device("cpu")).tolist() == [0, 2, 4, 6]


BATCH = (2, 32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("planning") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _linear_flops(tokens: int) -> int:
    """2·tokens·Σ(in·out) over every Linear of the tiny Llama: q, k, v, o, gate, up, down, head."""
    h, inter, heads, kv, vocab, layers = 64, 128, 4, 2, 512, 4
    head_dim = h // heads
    per_layer = h * h + 2 * h * kv * head_dim + h * h + 3 * h * inter
    return 2 * tokens * (layers * per_layer + h * vocab)


def test_the_anchor_step_does_three_times_the_forward_gemm_flops(tiny):
    """Forward, input gradient and weight gradient: 3 × 2·tokens·Σ(in·out) on the weights, in
    BF16 under autocast (the head included), plus attention's own. Older transformers (5.17, the
    GPU machine's) compute the rotary angles as an FP32 product with autocast off, once per
    forward: inv_freq (d/2 × 1) times the positions (1 × s), one row of positions for the batch;
    newer ones multiply elementwise, no GEMM."""
    count = count_step(ANCHOR, tiny, BATCH, layers=4, compiled_layers=False)
    flops = count.total().flops
    b, s, heads, d, layers = BATCH[0], BATCH[1], 4, 16, 4
    assert flops.pop(torch.float32, 0) in (0, 2 * (d // 2) * s)
    assert set(flops) == {torch.bfloat16}
    attention = flops[torch.bfloat16] - 3 * _linear_flops(BATCH[0] * BATCH[1])
    # Attention: 4·B·H·S²·D forward and 2.5× that backward per layer, halved: the kernel is told
    # the mask is causal, as on a real batch (no mask tensor, which would mean full work).
    full = int(3.5 * 4 * b * heads * s * s * d * layers)
    assert attention == full // 2


def test_a_causal_lm_is_counted_as_a_real_batch_runs_it_causal_attention_with_no_mask(tiny, monkeypatch):
    """With no attention mask and no cache, transformers asks whether the batch packs several
    sequences; on real tensors the answer is no and SDPA gets `attn_mask=None, is_causal=True`.
    The count runs on fake tensors, which cannot answer: it must still count that call."""
    from hf_lowprec.planning.models import build_model

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    real = build_model(tiny, device="cpu", use_cache=False)
    ids = torch.randint(0, 512, BATCH)
    real(input_ids=ids, labels=ids)
    assert calls and set(calls) == {(True, True)}, calls  # what a real run passes
    calls.clear()
    count_step("bf16-mixed", tiny, BATCH, layers=2, compiled_layers=False)
    assert calls and set(calls) == {(True, True)}, calls


@pytest.mark.parametrize("name", ["bf16-mixed", "fp8-lm-o1", "fp8-lm-o2", "collage-plus"])
def test_launches_outside_the_compiled_layers_do_not_grow_with_depth(tiny, name):
    """Regional compilation: what runs outside the decoder layers (embedding, head, loss,
    gradient processing, clipping, the optimizer) is a fixed number of launches, not one per
    parameter, but for the optimizer's compiled calls, one per chunk of at most eight parameters
    (`optim.dispatch.chunks_of`). (torch's fused AdamW, the anchor, launches one kernel per 36
    parameters: it grows.)"""
    two, four = (count_step(name, tiny, BATCH, layers=n) for n in (2, 4))
    assert four.total().eager == two.total().eager
    # The optimizer's, FP8-LM O1's gradient casts and O2's clipping (`compiling.run_fused_rows`).
    chunks = sum(four.phases[p].graphs - two.phases[p].graphs for p in ("optimizer", "gradients", "clip"))
    assert four.total().graphs - two.total().graphs - chunks == 2 * 2  # each added layer: a forward graph, a backward
    assert 0 <= chunks <= 2 * (-(-2 * 9 // 8) + CHUNK_ROUNDING)  # nine parameters a Llama layer


def test_a_deep_model_is_counted_at_two_depths_and_scaled(tiny):
    scaled = count_scaled("bf16-mixed", tiny, BATCH).total()
    full = count_step("bf16-mixed", tiny, BATCH, layers=4).total()
    assert abs(scaled.kernels - full.kernels) <= CHUNK_ROUNDING  # the optimizer's chunks (tests.helpers)
    assert scaled.flops == full.flops
    assert scaled.bytes == pytest.approx(full.bytes, rel=0.02)


def _everything(count):
    """Every figure of a counted step, per phase."""
    return (
        count.peak_bytes,
        count.resident_bytes,
        {
            phase: (c.kernels, c.graphs, c.eager, c.bytes, c.syncs, dict(c.flops), sorted(map(str, c.gemm_kernels)))
            for phase, c in count.phases.items()
        },
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-layers"])
@pytest.mark.parametrize("name", ["fp8-lm-o2", "collage-8bit", "coat", "bf16-sr"])
def test_replayed_pure_calls_count_what_running_them_counts(tiny, monkeypatch, name, compiled):
    """A pure call (an FP8 cast, an optimizer row) with the shapes of one recorded before is
    replayed, not run (docs/planning.md, "Counting time"): kernels, graphs, bytes, FLOPs, syncs,
    peak and resident bytes are those of running every call, eager and with compiled layers
    (where a row's first kernel fuses with the one the row before left open)."""
    replayed = []
    replay = Ledger._replay

    def counting_replays(self, *args):
        replayed.append(1)
        return replay(self, *args)

    monkeypatch.setattr(Ledger, "_replay", counting_replays)
    fast = count_step(name, tiny, BATCH, layers=4, compiled_layers=compiled)
    assert len(replayed) >= 8  # the 4 layers' rows and casts: most calls were replayed

    monkeypatch.setattr(Ledger, "call_pure", lambda self, key, fn, args, kwargs: fn(*args, **kwargs))
    assert _everything(fast) == _everything(count_step(name, tiny, BATCH, layers=4, compiled_layers=compiled))


def test_counts_in_worker_processes_equal_counts_in_this_one(tiny):
    """`start_counts` (forked workers on a machine with two cores or more) gives what counting
    each strategy here gives."""
    from hf_lowprec.planning.counting import start_counts

    names = ["bf16-mixed", "fp8-lm-o2", ANCHOR]
    parallel = start_counts(names, tiny, BATCH, compiled_layers=False)()
    assert list(parallel) == names
    for name in names:
        assert _everything(parallel[name]) == _everything(count_scaled(name, tiny, BATCH, compiled_layers=False))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-layers"])
def test_o2_takes_the_weights_its_optimizer_wrote_only_where_the_model_runs_eagerly(tiny, monkeypatch, compiled):
    """Eagerly on a GPU, fp8-lm-o2's forward takes the FP8 weights FP8AdamW wrote (no weight
    cast); in a compiled layer the graph casts each weight at every forward, as `torch.compile`
    runs it (`compiling.in_compiled_model`), so the count with compiled layers is the count of a
    forward that casts."""
    from hf_lowprec.fp8.linear import FP8Linear

    written = count_step("fp8-lm-o2", tiny, BATCH, layers=2, compiled_layers=compiled)
    monkeypatch.setattr(FP8Linear, "_takes_written_weight", lambda self: False)
    cast = count_step("fp8-lm-o2", tiny, BATCH, layers=2, compiled_layers=compiled)
    saved = cast.phases["forward"].kernels - written.phases["forward"].kernels
    # Two kernels a weight (its amax, then its cast) for 2 layers × 7 FP8 linears, eagerly.
    assert saved == (0 if compiled else 2 * 2 * 7)
