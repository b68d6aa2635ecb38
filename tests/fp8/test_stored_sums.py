"""FP8-LM O3's ZeRO clipping and skip masking over the stored FP8 gradients (`fp8.stored_sums`,
`FP8ZeroAdamW.clip_coefficient`): the GPU's form (compiled calls over chunks) gives the per-weight
loop's bits, and its launches do not grow with the layers (issue #66)."""

import types

import torch

from hf_lowprec.compiling import gpu_paths
from hf_lowprec.fp8.gemm import set_fp8_gemm_path
from hf_lowprec.fp8.stored_sums import mask_skipped_stored
from hf_lowprec.optim.zero_fp8 import FP8ZeroAdamW
from hf_lowprec.testing.counted_step import checked_strategy, gpt2, strategy_step, token_batch
from hf_lowprec.testing.launches import Launches
from tests.helpers import bits_equal

DENSE_NORM, MAX_NORM = 0.75, 1e-3  # DeepSpeed's norm of the dense partitions; a clipping that acts


REAL_CLIP_COEFFICIENT = FP8ZeroAdamW.clip_coefficient  # not a wrapper an earlier call left patched in


def _clipped_under_zero(n_layer, gpu, monkeypatch):
    """The third step's `clip_coefficient` of fp8-lm-o3 (one process, eager model) with a stand-in
    for DeepSpeed's ZeRO optimizer holding the two attributes it reads: the stored FP8 gradients
    before, the norm and scales after, and its launches."""
    real, seen = REAL_CLIP_COEFFICIENT, []

    def under_zero(self):
        self.zero_optimizer = types.SimpleNamespace(_global_grad_norm=torch.tensor(DENSE_NORM), clip_grad=MAX_NORM)
        before = [(payload.clone(), scale.clone()) for payload, scale in _stored(self)]
        with Launches() as counted:
            total = real(self)
        seen.append((before, total.clone(), [s.clone() for _, s in _stored(self)], counted))
        self.zero_optimizer, self._dense_factor = None, None  # the rest of the step as one process
        return total

    monkeypatch.setattr(FP8ZeroAdamW, "clip_coefficient", under_zero)
    set_fp8_gemm_path("scaled_mm")
    try:
        with torch.compiler.set_stance("force_eager"), gpu_paths() if gpu else torch.no_grad():
            strategy = checked_strategy("fp8-lm-o3")
            model = strategy.prepare_model(gpt2(n_layer))
            optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
            ids = token_batch()
            with torch.enable_grad():
                for _ in range(3):
                    strategy_step(strategy, model, optimizer, ids)
    finally:
        set_fp8_gemm_path(None)
    return seen[-1]


def _stored(optimizer):
    """The FP8 gradients (payload, scale) the rank holds, in its owned weights' order."""
    pending = (optimizer.fp8_grad(optimizer.fp8_params[i]) for i in optimizer.owned)
    return [stored for stored in pending if stored is not None]


def _the_loop(before):
    """What `clip_coefficient` computed before (its per-weight loop): the norm and the new scales."""
    squares = torch.zeros((), dtype=torch.float32)
    for payload, scale in before:
        squares += (torch.linalg.vector_norm(payload.float()) / scale).square()
    dense = torch.tensor(DENSE_NORM)
    total = (dense.square() + squares).sqrt()
    ours = torch.where(torch.isfinite(total), torch.clamp((total + 1e-6) / MAX_NORM, min=1.0), 1.0)
    return total, [scale * ours for _, scale in before]


def test_o3_zero_clipping_gives_the_loops_bits_and_does_not_grow_with_the_layers(monkeypatch):
    """It was six eager launches per owned FP8 weight (widen, norm, divide, square, add, then the
    scale's product: 67 at 2 layers, 115 at 4); now one compiled call per chunk of eight weights and
    one multi-tensor product, the same at any depth but for the chunks."""
    counts, summaries = {}, {}
    for n_layer in (2, 4):
        for gpu in (False, True):
            before, total, scales, counted = _clipped_under_zero(n_layer, gpu, monkeypatch)
            assert len(before) == 4 * n_layer  # every FP8 linear's weight: one process owns them all
            expected_total, expected_scales = _the_loop(before)
            assert bits_equal(total, expected_total), (n_layer, gpu, total, expected_total)
            assert all(bits_equal(a, b) for a, b in zip(scales, expected_scales, strict=True)), (n_layer, gpu)
            # The norm against FP64: each FP32 norm sums its squares in a cascade (relative error about
            # log2(n)·2^-24 ≈ 1.3e-6 for n < 2^22 elements), the rest adds a few roundings: 1e-5.
            exact = (
                sum((payload.double().square().sum() / scale.double() ** 2) for payload, scale in before)
                + DENSE_NORM**2
            )
            assert abs(float(total) - float(exact) ** 0.5) <= 1e-5 * float(exact) ** 0.5
            if gpu:
                chunks = counted.regions[("step", "squares_of_stored")]
                # Chunks of at most 8 within groups (rank, dtype, size class): each group's last chunks add at most 3.
                assert chunks <= -(-len(before) // 8) + 2 * 3, counted.summary()
                counts[n_layer] = counted.total() - chunks
                summaries[n_layer] = counted.summary()
    assert counts[2] == counts[4] <= 25, (counts, summaries)


def test_the_skip_mask_of_the_stored_gradients_is_the_loops_in_a_few_launches():
    """Where the step's flag is set, every stored FP8 gradient zeroed (bytes) with scale 1, NaN
    payloads and non-finite scales included; unset, nothing changes. It was two eager launches per
    owned FP8 weight; on the GPU's form, one call per chunk of eight."""
    gen = torch.Generator().manual_seed(0)
    stored = [
        ((torch.randn(16, 8, generator=gen) * 100).to(torch.float8_e5m2), torch.tensor(2.0**k)) for k in range(11)
    ]
    stored[3][0].view(torch.uint8)[0, 0] = 0x7F  # a NaN payload
    stored[5][1].fill_(float("inf"))
    for flag in (0.0, 1.0):
        loop = [(p.clone(), s.clone()) for p, s in stored]
        for payload, scale in loop:  # the loop it replaces
            payload.view(torch.uint8).masked_fill_(torch.tensor(flag) != 0, 0)
            scale.masked_fill_(torch.tensor(flag) != 0, 1.0)
        for gpu in (False, True):
            ours = [(p.clone(), s.clone()) for p, s in stored]
            with (
                torch.compiler.set_stance("force_eager"),
                gpu_paths() if gpu else torch.no_grad(),
                Launches() as counted,
            ):
                mask_skipped_stored(ours, torch.tensor(flag))
            for (a, sa), (b, sb) in zip(ours, loop, strict=True):
                assert bits_equal(a, b) and bits_equal(sa, sb), (flag, gpu)
            if gpu:
                assert counted.total() == 1 + 3, counted.summary()  # the flag's test; chunks of 8, 2 and 1
