"""FP8 gradient all-reduce with one shared scale per tensor (FP8-LM §2.1, eqs. 4–6; docs/algorithms.md §3).

`fp8_allreduce` averages a gradient over ranks with FP8 on the wire, `fp8_allreduce_hook` is it as
a DDP communication hook, `prescale_allreduce` and `postscale_allreduce` are the paper's baselines
(eqs. 1–2), and `all_gather_owned_fp8` is FP8 ZeRO's (fp8-lm-o3) all-gather of the owners' weights.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations with the real
# `dist.GradBucket` and `Future[Tensor]` objects and rejects strings.
import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..compiling import constant, run_fused, takes_gpu_path
from ..numerics import abs_max
from .gradients import GradientAutoScaler
from .scaled import pow2_scale, saturated_count, saturating_cast

__all__ = [
    "AllReduceStats",
    "FP8AllReduceResult",
    "FP8CommState",
    "all_gather_owned_fp8",
    "fp8_allreduce",
    "fp8_allreduce_hook",
    "postscale_allreduce",
    "prescale_allreduce",
]

logger = logging.getLogger(__name__)
# `FP8CommState.prescale` puts a gradient's amax 12 binades under FP16's maximum.
_PRESCALE_MARGIN = 12


def _prescaled(
    grad: torch.Tensor, peak: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(grad·σ in `dtype`, peak, σ, σ/σ_before): peak = the largest amax of the step's micro-batches
    so far (`peak` None: this is the first), σ = 2^k putting it in (8, 16] (1 while it is 0 or not
    finite, `pow2_scale`), and the ratio that moves what was accumulated at the σ before to this σ
    (None for the first micro-batch). Powers of two: every product is exact but for FP16's rounding."""
    amax = abs_max(grad).float()
    sigma_before = None if peak is None else pow2_scale(peak, torch.float16, _PRESCALE_MARGIN)
    peak = amax if peak is None else torch.maximum(peak, amax)
    sigma = pow2_scale(peak, torch.float16, _PRESCALE_MARGIN)
    ratio = None if sigma_before is None else sigma / sigma_before
    return (grad.float() * sigma).to(dtype), peak, sigma, ratio


@dataclasses.dataclass
class AllReduceStats:
    """What an FP8 all-reduce lost, summed over ranks.

    Attributes:
        underflow: nonzero gradient elements that became FP8 zero on their rank (an int64
            device tensor after a reduction: read it at logging steps).
        overflow: elements clipped at the FP8 maximum, in a rank's cast or in the sum (same).
        numel: elements of the reduced tensor (per rank).
    """

    underflow: torch.Tensor | int = 0
    overflow: torch.Tensor | int = 0
    numel: int = 0

    def counts(self) -> list[int]:
        """[underflow, overflow, numel] as Python ints (reads the device: checkpoints only)."""
        return [int(self.underflow), int(self.overflow), self.numel]

    def __iadd__(self, other: "AllReduceStats") -> "AllReduceStats":
        self.underflow += other.underflow
        self.overflow += other.overflow
        self.numel += other.numel
        return self


@dataclasses.dataclass
class FP8AllReduceResult:
    """The reduced FP8 payload and its per-segment scales: mean = payload / scale.

    Attributes:
        payload: flat FP8 tensor, identical on every rank.
        scales: one FP32 scale per segment (N·μ·s_g).
        numels: segment sizes, in order.
        stats: underflow and overflow counts.
    """

    payload: torch.Tensor
    scales: torch.Tensor
    numels: list[int]
    stats: AllReduceStats

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The mean gradient, flat, in `dtype`."""
        return (self.payload.float() / _per_element(self.scales, self.numels)).to(dtype)


@constant
def _segment_sizes(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Built once per layout and device: a bucket's layout repeats every step.
    return torch.tensor(numels, device=device)


def _per_element(values: torch.Tensor, numels: Sequence[int]) -> torch.Tensor:
    """values[i] repeated numels[i] times; the output size is known, so no host sync."""
    sizes = _segment_sizes(tuple(numels), values.device)
    return torch.repeat_interleave(values, sizes, output_size=sum(numels))


def _all_gather_bytes(out: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, chunk, group=group)


def _reduce(
    flat: torch.Tensor,
    numels: Sequence[int] | None,
    *,
    mu: float | torch.Tensor | None,
    fp8_dtype: torch.dtype,
    margin: int,
    group: dist.ProcessGroup | None,
    prescales: torch.Tensor | None = None,
) -> FP8AllReduceResult:
    """The shared-scale pipeline; `mu=None` means pre-scaling (μ = 1/N); `prescales`: one power of
    two per segment that the local segment carries (real = flat / prescale), or None.

    Transport: gloo (and NCCL without FP8) cannot add FP8, so the payload travels as uint8 bytes
    and is added upcast: a reduce-scatter by `all_to_all_single` (each rank receives every
    rank's copy of one chunk and adds them in FP32, in fixed rank order), the chunk is rounded
    to FP8 once, and `all_gather` returns the FP8 sums. FP8 is all that crosses the wire,
    2(N−1)/N bytes per element per rank as in a ring all-reduce, plus per-tensor scalars (the
    MIN of the scales and one all-reduce of two counters).
    """
    if flat.dim() != 1:
        raise ValueError(f"FP8 all-reduce works on a flat tensor, got shape {tuple(flat.shape)}")
    if not flat.is_floating_point():
        raise ValueError(f"FP8 all-reduce needs a floating-point gradient, got {flat.dtype}")
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    numels = [flat.numel()] if numels is None else [int(n) for n in numels]
    if sum(numels) != flat.numel() or any(n < 0 for n in numels):
        raise ValueError(f"segment sizes {numels} do not add up to the tensor size {flat.numel()}")
    if not dist.is_initialized():
        raise ValueError("FP8 all-reduce needs an initialized torch.distributed process group")
    world = dist.get_world_size(group)
    device = flat.device

    segments = flat.detach().split(numels)
    # One multi-tensor launch on a GPU, not two per segment (max |x| is exact either way); it takes no empty one.
    if takes_gpu_path(device) and all(s.numel() for s in segments):
        amax = torch.stack(torch._foreach_norm(list(segments), math.inf)).float()
    else:
        amax = torch.stack([s.abs().amax().float() if s.numel() else torch.zeros((), device=device) for s in segments])
    if prescales is not None:  # exact: powers of two
        amax = amax / prescales
    # An all-zero segment (an unused parameter, an expert without tokens) has nothing to fit:
    # its scale is +inf in the MIN, so it cannot force scale 1 on ranks that hold values.
    shared = torch.where(amax == 0, torch.full_like(amax, float("inf")), pow2_scale(amax, fp8_dtype, margin))
    dist.all_reduce(shared, op=dist.ReduceOp.MIN, group=group)
    shared = torch.where(torch.isinf(shared), torch.ones_like(shared), shared)  # zero on every rank
    send_scale = shared * (1.0 / world if mu is None else mu)

    scaled = flat.float() * _per_element(send_scale if prescales is None else send_scale / prescales, numels)
    payload = saturating_cast(scaled, fp8_dtype)
    overflow = saturated_count(scaled, fp8_dtype)
    del scaled
    # ±0 in FP8 is 0x00 or 0x80: test the bytes rather than upcasting the payload.
    underflow = ((payload.view(torch.uint8) & 0x7F) == 0).logical_and_(flat != 0).sum()

    numel = flat.numel()
    chunk = -(-numel // world)
    send = torch.zeros(chunk * world, dtype=torch.uint8, device=device)
    send[:numel] = payload.view(torch.uint8)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    copies = received.view(fp8_dtype).view(world, chunk)
    total = copies[0].float()
    for r in range(1, world):  # fixed order and FP32: the same sum on every rank, one chunk of memory
        total += copies[r].float()
    # Padding is zero on every rank, so it neither saturates nor underflows.
    overflow = overflow + saturated_count(total, fp8_dtype)
    reduced = saturating_cast(total, fp8_dtype).view(torch.uint8)
    gathered = torch.empty(chunk * world, dtype=torch.uint8, device=device)
    _all_gather_bytes(gathered, reduced, group)

    counts = torch.stack([overflow, underflow]).to(torch.int64)
    dist.all_reduce(counts, group=group)
    stats = AllReduceStats(underflow=counts[1], overflow=counts[0], numel=numel)
    return FP8AllReduceResult(gathered[:numel].view(fp8_dtype), send_scale * world, numels, stats)


def fp8_allreduce(
    tensor: torch.Tensor,
    *,
    numels: Sequence[int] | None = None,
    mu: float | torch.Tensor = 1.0,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    margin: int = 0,
    group: dist.ProcessGroup | None = None,
    prescales: torch.Tensor | None = None,
) -> FP8AllReduceResult:
    """Mean of a flat gradient over ranks with one shared scale per segment (FP8-LM eqs. 4–6).

    Rank i holds gradient gᵢ of each segment:

        sᵢ   = 2^(floor(log2(fp8_max / amax(gᵢ))) − margin)     local power-of-two scale
        s_g  = min_i sᵢ                                         all-reduce MIN, one scalar per segment
                                                                (sᵢ = +∞ where gᵢ is all zero)
        gᵢ'' = FP8(μ·s_g·gᵢ)                                    requantize to the shared scale
        g    = FP8(Σᵢ gᵢ''),  s = N·μ·s_g                       real mean = g / s

    μ is the automatic gradient scale (`GradientAutoScaler`): the sum of N payloads can exceed
    the FP8 maximum, and μ shrinks until that happens to at most 0.001 % of the elements.
    Requantizing from the high-precision gradient (rather than from a local FP8 copy, as the
    paper's eq. 5 reads) gives the same payload when s_g = sᵢ and avoids a second rounding
    otherwise.

    Args:
        tensor: flat local gradient (FP32, FP16 or BF16); not modified.
        numels: sizes of the consecutive segments (one per parameter) that get their own
            scale; None for a single segment.
        mu: automatic gradient scale μ (the same on every rank).
        fp8_dtype: wire format.
        margin: scale margin in binades.
        group: process group (default: the world).
        prescales: FP32 powers of two, one per segment, that this rank's segments carry
            (gᵢ = segment / prescale: `FP8CommState.prescale`), or None.
    """
    if not torch.is_tensor(mu) and not (mu > 0):  # a tensor μ comes from GradientAutoScaler, positive
        raise ValueError(f"mu must be positive, got {mu}")
    return _reduce(tensor, numels, mu=mu, fp8_dtype=fp8_dtype, margin=margin, group=group, prescales=prescales)


def prescale_allreduce(
    tensor: torch.Tensor,
    *,
    numels: Sequence[int] | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    margin: int = 0,
    group: dist.ProcessGroup | None = None,
) -> FP8AllReduceResult:
    """Baseline, eq. 1: g = Σ FP8(gᵢ/N) — each rank divides by N before the sum (the shared-scale
    pipeline with μ = 1/N); small values underflow."""
    return _reduce(tensor, numels, mu=None, fp8_dtype=fp8_dtype, margin=margin, group=group)


def postscale_allreduce(
    tensor: torch.Tensor,
    *,
    numels: Sequence[int] | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    margin: int = 0,
    group: dist.ProcessGroup | None = None,
) -> FP8AllReduceResult:
    """Baseline, eq. 2: g = (Σ FP8(gᵢ))/N — the shared-scale pipeline with μ = 1; the sum of
    near-maximal payloads overflows."""
    return _reduce(tensor, numels, mu=1.0, fp8_dtype=fp8_dtype, margin=margin, group=group)


@dataclasses.dataclass
class FP8CommState:
    """The `state` argument of `fp8_allreduce_hook`.

    Attributes:
        scaler: the automatic gradient scale μ; the hook records its clipped-element counts,
            and the owner calls `scaler.update()` once per optimizer step.
        fp8_dtype: wire format.
        margin: scale margin in binades.
        process_group: None for the default group.
        grad_scales: id(parameter) → scale of its reduced FP8 gradient (N·μ·s_g), for the
            owner to store the gradient as FP8 without rounding it again.
        stats: underflow/overflow counts accumulated since the owner last reset them (fp8-lm:
            at each log, and checkpointed).
        prescales: id(parameter) → the power of two σ its bucket gradient carries this step
            (`prescale`), taken by the hook.
        peaks: id(parameter) → the largest gradient amax of this step's micro-batches so far,
            which σ follows (`prescale`), dropped by the hook.
        store: where the hook hands the prescaled parameters' reduced gradients of a bucket, in one
            call `store(params, payloads, scales)`; it returns a bool per parameter, True: stored,
            its part of the bucket is zeroed (fp8-lm-o2: the optimizer, in a few launches).
    """

    scaler: GradientAutoScaler
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    margin: int = 0
    process_group: dist.ProcessGroup | None = None
    grad_scales: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    stats: AllReduceStats = dataclasses.field(default_factory=AllReduceStats)
    prescales: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    store: Callable[[list, list, list], list[bool]] | None = None
    peaks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    _backwards: dict[int, int] = dataclasses.field(default_factory=dict, repr=False)  # id → graph task

    def prescale(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """grad·σ in `param`'s dtype (an FP16 bucket), σ = 2^k putting the largest amax of this
        step's micro-batches so far in (8, 16]: FP16 holds 28 binades below it (FP8's range and
        more), and the accumulated sum up to 2^12 times it. Without σ gradients under 2^-24 flush to
        0 before the FP8 all-reduce. A micro-batch with a larger amax lowers σ (one that follows
        all-zero ones sets it) and `param.grad`, the sum accumulated at the σ before, is multiplied
        by the same power of two on the device, so the bucket holds the exact rescaled sum: no
        micro-batch overflows FP16 at an earlier one's σ, or underflows at the σ of a zero one.
        No host sync; one graph and one multiplication on a GPU. A weight one backward uses twice
        sends its second use at the first's σ (autograd holds the first use's gradient, unsummed
        and out of reach, until both are added)."""
        key, peak = id(param), self.peaks.get(id(param))
        task = torch._C._current_graph_task_id()
        if peak is not None and task >= 0 and self._backwards.get(key) == task:
            return (grad * self.prescales[key]).to(param.dtype)
        self._backwards[key] = task
        args = (grad.detach(), peak, param.dtype)
        out = run_fused(_prescaled, *args, like=grad) if takes_gpu_path(grad.device) else _prescaled(*args)
        scaled, self.peaks[key], self.prescales[key], ratio = out
        if ratio is not None and param.grad is not None:
            param.grad.mul_(ratio)
        return scaled

    def take_prescale(self, param: torch.Tensor) -> torch.Tensor | None:
        """σ of `param`'s bucket gradient this step (None: not prescaled), forgetting the step's state."""
        self.peaks.pop(id(param), None)
        self._backwards.pop(id(param), None)
        return self.prescales.pop(id(param), None)


def fp8_allreduce_hook(state: FP8CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients in FP8 with shared scales.

    Register with `ddp_model.register_comm_hook(state, fp8_allreduce_hook)`. The bucket
    receives the dequantized mean, so DDP and the optimizer see ordinary gradients whose
    values are exactly the FP8 ones.
    """
    buffer = bucket.buffer()
    grads = bucket.gradients()
    params = bucket.parameters()
    numels = [g.numel() for g in grads]
    sigmas = [state.take_prescale(p) for p in params]
    if sum(numels) != buffer.numel():
        # Buckets with alignment gaps: fall back to one scale for the whole bucket, in real units.
        logger.debug("bucket %d has gaps between gradients; using one scale for it", bucket.index())
        for grad, sigma in zip(grads, sigmas):
            if sigma is not None:
                grad.div_(sigma)
        numels, params, sigmas = [buffer.numel()], [], [None]
    one = torch.ones((), device=buffer.device)
    prescales = None if all(s is None for s in sigmas) else torch.stack([one if s is None else s for s in sigmas])
    result = fp8_allreduce(
        buffer,
        numels=numels,
        mu=state.scaler.mu_for(buffer),
        fp8_dtype=state.fp8_dtype,
        margin=state.margin,
        group=state.process_group,
        prescales=prescales,
    )
    state.scaler.record(result.stats.overflow, result.stats.numel)
    state.stats += result.stats
    scales, payloads, parts = result.scales.unbind(), result.payload.split(numels), buffer.split(numels)
    # The prescaled weights' FP8 gradients go to `state.store` in one call (a few launches per bucket).
    offered = [i for i, sigma in enumerate(sigmas) if sigma is not None] if state.store is not None else []
    taken = []
    if offered:
        shaped = [payloads[i].view(params[i].shape) for i in offered]
        taken = state.store([params[i] for i in offered], shaped, [scales[i] for i in offered])
    kept = {i for i, took in zip(offered, taken) if took}
    stored = [parts[i] for i in sorted(kept)]  # the bucket's parts whose gradient went to `state.store` as FP8
    state.grad_scales.update((id(p), scales[i]) for i, p in enumerate(params) if i not in kept)
    buffer.copy_(result.dequantize(buffer.dtype))
    if stored:
        torch._foreach_zero_(stored)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def all_gather_owned_fp8(
    owned: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    numels: Sequence[int],
    owners: Sequence[int],
    *,
    device: torch.device,
    dtype: torch.dtype = torch.float8_e4m3fn,
    group: dist.ProcessGroup | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's whole FP8 tensors to every rank: 1 byte per element on the wire.

    Tensor i (of `numels[i]` elements) is owned by rank `owners[i]`; rank r packs its tensors
    in index order into one uint8 buffer, padded to the largest rank's total, and one
    `all_gather_into_tensor` moves the buffers. The scales travel as one FP32 vector summed
    over ranks (each entry is nonzero on its owner only, so the sum is exact).

    Args:
        owned: (index, FP8 payload, FP32 scalar scale) of each tensor this rank owns.
        numels: element count of every tensor.
        owners: owning rank of every tensor (the same list on every rank).
        device: the device of the payloads, where every buffer of the collective lives
            (NCCL takes CUDA tensors only, gloo CPU ones).
        dtype: the FP8 format of the payloads.
        group: process group (default: the world).

    Returns:
        (payloads, scales): flat FP8 views into one receive buffer, one per tensor, and the
        FP32 scales (real = payload / scale).
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    per_rank = [0] * world
    for numel, owner in zip(numels, owners):
        per_rank[owner] += int(numel)
    size = max(per_rank, default=0)
    send = torch.zeros(size, dtype=torch.uint8, device=device)
    scales = torch.zeros(len(numels), dtype=torch.float32, device=device)
    offset = 0
    for index, payload, scale in sorted(owned, key=lambda item: item[0]):
        if owners[index] != rank:
            raise ValueError(f"tensor {index} is owned by rank {owners[index]}, not by this rank {rank}")
        send[offset : offset + payload.numel()] = payload.reshape(-1).view(torch.uint8)
        offset += payload.numel()
        scales[index] = scale
    received = torch.empty(size * world, dtype=torch.uint8, device=device)
    _all_gather_bytes(received, send, group)
    dist.all_reduce(scales, group=group)
    payloads, offsets = [], [0] * world
    for numel, owner in zip(numels, owners):
        start = owner * size + offsets[owner]
        offsets[owner] += int(numel)
        payloads.append(received[start : start + int(numel)].view(dtype))
    return payloads, scales
