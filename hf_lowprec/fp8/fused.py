"""One compiled pass per FP8 operand: amax, power-of-two scale and cast (and for a weight gradient
its accumulation and saturation count) as one graph, on CPU (C++/OpenMP) and CUDA (Triton) alike.
Run eagerly they are a chain of ~20 small ops per tensor, which on a GPU the host cannot issue as
fast as the device runs them (docs/benchmarks.md, "Launches per step"); likewise FP8-LM's μ
update (`mu_update`). The eager functions here are the reference: the compiled graph gives their
bits (tests/fp8/test_fused.py, tests/fp8/test_gradients.py).
"""

from __future__ import annotations

import torch

from ..compiling import run_fused, run_fused_rows
from ..numerics import abs_max
from .cast import saturate_to_fp8_eager
from .scaled import pow2_scale

E4M3 = torch.float8_e4m3fn

__all__ = [
    "FLUSH_BELOW",
    "counted_input_cast",
    "gradient_cast",
    "gradient_cast_into",
    "gradients_cast_into",
    "gradient_roundtrip_",
    "gradients_roundtrip_",
    "mu_update",
    "tensorwise_cast",
    "tensorwise_cast_transposed",
]


# Half of E4M3's smallest subnormal (2^-9): a scaled value at or below it rounds to zero (the tie
# goes to the even neighbour, 0).
FLUSH_BELOW = 2.0**-10


def _tensorwise(
    x: torch.Tensor, dtype: torch.dtype, margin: int, master_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    scaled, scale = _scaled(x, dtype, margin, master_scale)
    return scaled.to(dtype), scale


def _scaled(
    x: torch.Tensor, dtype: torch.dtype, margin: int, master_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x·s in FP32, s): what the tensorwise cast rounds to `dtype`."""
    amax = abs_max(x).float()
    if master_scale is not None:
        amax = amax / master_scale
    scale = pow2_scale(amax, dtype, margin)
    # amax − amax is 0, or NaN when amax is inf/NaN: a non-finite input gives a NaN payload.
    factor = scale + (amax - amax)
    if master_scale is not None:
        # x holds real·s_m, so multiplying by s/s_m (a power of two) yields real·s.
        factor = factor / master_scale
    return x.float() * factor, scale


def tensorwise_cast(
    x: torch.Tensor, dtype: torch.dtype, margin: int = 0, master_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, s): s the power-of-two scale of the real values x / master_scale (a 0-dim FP32
    tensor), payload = x·s (times 1/master_scale) cast to `dtype` (nearest even). The scale comes
    from x's own amax, so nothing saturates; an inf or NaN in x makes the payload NaN."""
    x = x.detach()
    if master_scale is not None:
        master_scale = master_scale.float()
    payload, scale = run_fused(_tensorwise, x.reshape(-1), dtype, margin, master_scale, like=x)
    return payload.view(x.shape), scale


def _tensorwise_transposed(x: torch.Tensor, dtype: torch.dtype, margin: int) -> tuple[torch.Tensor, ...]:
    payload, scale = _tensorwise(x, dtype, margin, None)
    return payload, payload.t().contiguous(), scale


def tensorwise_cast_transposed(
    x: torch.Tensor, dtype: torch.dtype, margin: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(payload, its transpose made contiguous, s) of a 2-D `x`, as `tensorwise_cast` gives the
    payload and s, in one graph: `torch._scaled_mm` takes its first operand row-major and its
    second column-major, so a weight gradient dyᵀ·x needs dy's FP8 payload in both layouts (an
    eager transposing copy is one more launch)."""
    return run_fused(_tensorwise_transposed, x.detach(), dtype, margin, like=x)


def _input_counted(x: torch.Tensor, margin: int, transposed: bool) -> tuple[torch.Tensor | None, ...]:
    scaled, scale = _scaled(x, E4M3, margin, None)
    payload = scaled.to(E4M3)
    payload_t = payload.t().contiguous() if transposed else None
    nonzero = x != 0
    # Flushed: non-zero, and |x·s| at or below FLUSH_BELOW, where the E4M3 rounding gives 0.
    counts = torch.stack([nonzero & (scaled.abs() <= FLUSH_BELOW), nonzero]).reshape(2, -1).sum(1)
    return payload, payload_t, scale, counts


def counted_input_cast(
    x: torch.Tensor, margin: int, transposed: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(payload, its transpose made contiguous or None, s, counts) of a layer's 2-D input in E4M3,
    as `tensorwise_cast` (and `tensorwise_cast_transposed`) give them, and in the same graph
    counts = [inputs the cast flushes to zero, non-zero inputs] (int64): what the guard watches
    (docs/guard.md). The counting rides in the cast's own pass over x: no kernel of its own."""
    return run_fused(_input_counted, x.detach(), margin, transposed, like=x)


def _gradient(
    grad: torch.Tensor,
    mu: torch.Tensor,
    dtype: torch.dtype,
    margin: int,
    pending: torch.Tensor | None,
    pending_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if pending is not None:
        # Gradient accumulation: this micro-batch's gradient added to the stored one, in FP32.
        grad = pending.float() / pending_scale + grad
    amax = abs_max(grad).float()
    scale = pow2_scale(amax, dtype, margin) * mu
    payload, saturated = saturate_to_fp8_eager(grad, scale, dtype)
    # The payload holds NaN exactly when the amax (which propagates NaN) or the scale (μ at its
    # ceiling over a subnormal amax overflows it) is not finite: |x·s| ≤ amax·s ≤ max·μ is finite
    # otherwise, and the saturating cast keeps it so. The step's flag, without a second pass.
    return payload, scale, saturated, ~(torch.isfinite(amax) & torch.isfinite(scale))


def gradient_cast(
    grad: torch.Tensor,
    mu: torch.Tensor,
    dtype: torch.dtype,
    margin: int = 0,
    pending: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(payload, scale, saturated, nonfinite) of the FP8 gradient (`gradients.quantize_gradient`'s
    rule: s = μ·2^(floor(log2(max/amax)) − margin), saturating cast, clipped count as an int64
    tensor, and a 0-dim bool flag: the payload holds NaN); with `pending` (payload, scale) of a
    gradient stored earlier in the step, of their FP32 sum. `mu`: a 0-dim FP32 tensor on grad's
    device."""
    grad = grad.detach()
    flat_pending = (None, None) if pending is None else (pending[0].reshape(-1), pending[1].float())
    payload, scale, saturated, nonfinite = run_fused(
        _gradient, grad.reshape(-1), mu, dtype, margin, *flat_pending, like=grad
    )
    return payload.view(grad.shape), scale, saturated, nonfinite


def gradient_cast_into(
    grad: torch.Tensor,
    mu: torch.Tensor,
    dtype: torch.dtype,
    margin: int,
    into: tuple[torch.Tensor, torch.Tensor],
    accumulate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gradient_cast` written into `into` = (a contiguous payload buffer of `dtype`, a 0-dim FP32
    scale buffer) by the same graph, which launches no copy after it; with `accumulate`, of the
    sum of grad and the gradient the buffers hold. Returns (saturated, nonfinite)."""
    payload, scale = into
    if not payload.is_contiguous() or payload.shape != grad.shape:
        raise ValueError("gradient_cast_into writes a contiguous buffer of the gradient's shape")
    flat = payload.view(-1)
    return run_fused(_gradient_into, grad.detach().reshape(-1), mu, dtype, margin, flat, scale, accumulate, like=grad)


def _gradient_into(
    grad: torch.Tensor,
    mu: torch.Tensor,
    dtype: torch.dtype,
    margin: int,
    payload_buffer: torch.Tensor,
    scale_buffer: torch.Tensor,
    accumulate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    pending = (payload_buffer, scale_buffer.float()) if accumulate else (None, None)
    payload, scale, saturated, nonfinite = _gradient(grad, mu, dtype, margin, *pending)
    payload_buffer.copy_(payload)
    scale_buffer.view(1).copy_(scale.view(1))  # a 0-dim write through a view (see `mu_update`)
    return saturated, nonfinite


def gradients_cast_into(
    grads: list[torch.Tensor],
    mus: list[torch.Tensor],
    dtype: torch.dtype,
    margin: int,
    into: list[tuple[torch.Tensor, torch.Tensor]],
    skip: torch.Tensor | None,
) -> list[torch.Tensor]:
    """`gradient_cast_into` (no accumulation) of every gradient in `grads`, each with its μ, into
    its buffers, a compiled call per chunk of gradients (`run_fused_rows`); with `skip` (a 0-dim
    flag, nonzero: the step is skipped) the buffers get a zero payload and scale 1 instead, in the
    same graphs (no NaN stays in the state).
    Returns the clipped counts. Each gradient keeps its own amax and scale: the per-gradient
    bits. What a GPU step runs for FP8-LM O3's owned gradients (five launches per weight before)."""
    for grad, (payload, _) in zip(grads, into):
        if not payload.is_contiguous() or payload.shape != grad.shape:
            raise ValueError("gradients_cast_into writes contiguous buffers of the gradients' shapes")
    rows = [(g.detach().reshape(-1), mu, payload.view(-1), scale) for g, mu, (payload, scale) in zip(grads, mus, into)]
    return run_fused_rows(_gradients_into, rows, dtype, margin, skip, like=grads[0])


def _gradients_into(rows: list[tuple[torch.Tensor, ...]], dtype: torch.dtype, margin: int, skip: torch.Tensor | None):
    counts = []
    for grad, mu, payload_buffer, scale_buffer in rows:
        payload, scale, saturated, _ = _gradient(grad, mu, dtype, margin, None, None)
        if skip is not None:
            keep = skip == 0
            # The payload's bytes zeroed (FP8 +0): FP8 has no arithmetic here, its bits do.
            payload = torch.where(keep, payload.view(torch.uint8), 0).view(dtype)
            scale = torch.where(keep, scale, 1.0)
        payload_buffer.copy_(payload)
        scale_buffer.view(1).copy_(scale.view(1))  # a 0-dim write through a view (see `mu_update`)
        counts.append(saturated)
    return counts


def _gradient_roundtrip(grad: torch.Tensor, mu: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    payload, scale, saturated, _ = _gradient(grad, mu, dtype, margin, None, None)
    grad.copy_(payload.float() / scale)
    return saturated


def gradient_roundtrip_(grad: torch.Tensor, mu: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """Replace a contiguous gradient by its FP8 values (`gradient_cast`, then payload / scale written
    back in grad's dtype, as `cast.unscale_into` writes it), in one graph; returns the clipped count.
    FP8-LM O1 keeps its gradients this way: FP8 values in a wider tensor."""
    if not grad.is_contiguous():
        raise ValueError("gradient_roundtrip_ writes the gradient in place: it must be contiguous")
    return run_fused(_gradient_roundtrip, grad.detach().view(-1), mu, dtype, margin, like=grad)


def gradients_roundtrip_(
    grads: list[torch.Tensor], mus: list[torch.Tensor], dtype: torch.dtype, margin: int = 0
) -> list[torch.Tensor]:
    """`gradient_roundtrip_` of every gradient in `grads` (each with its μ in `mus`), a compiled
    call per chunk of gradients (`run_fused_rows`): each keeps its own amax and scale, so the bits
    are the per-gradient ones (an amax and an integer count do not depend on the order of a
    reduction). What a GPU step runs for FP8-LM O1's gradients, where one per gradient was twelve
    launches per layer."""
    for grad in grads:
        if not grad.is_contiguous():
            raise ValueError("gradients_roundtrip_ writes the gradients in place: they must be contiguous")
    rows = [(grad.detach().view(-1), mu) for grad, mu in zip(grads, mus)]
    return run_fused_rows(_gradients_roundtrip, rows, dtype, margin, like=grads[0])


def _gradients_roundtrip(
    rows: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype, margin: int
) -> list[torch.Tensor]:
    return [_gradient_roundtrip(grad, mu, dtype, margin) for grad, mu in rows]


# --- FP8-LM's automatic gradient scale μ (`gradients.GradientAutoScaler.update`) -----------------


def _tally(
    counts: list[torch.Tensor | int], sizes: int, flagged: list[tuple[torch.Tensor, list, int]]
) -> tuple[torch.Tensor | int, torch.Tensor | int]:
    """(clipped elements, elements) of a step; a quantization recorded with a set flag counts
    for neither. Exact integers summed (in FP64 for the flagged sizes, < 2^53)."""
    saturated: torch.Tensor | int = _sum(counts)
    total: torch.Tensor | int = sizes
    for flag, flagged_counts, flagged_sizes in flagged:
        keep = flag == 0
        saturated = saturated + torch.where(keep, _sum(flagged_counts), 0)
        total = total + keep.double() * flagged_sizes
    return saturated, total


def mu_update(
    mu: torch.Tensor,
    clean: torch.Tensor,
    last_share: torch.Tensor,
    counts: list[torch.Tensor | int],
    sizes: int,
    flagged: list[tuple[torch.Tensor, list, int]],
    unless: torch.Tensor | None,
    threshold: float,
    interval: int,
    min_mu: float,
    max_mu: float,
) -> torch.Tensor:
    """FP8-LM's rule on the device state (μ, clean steps, last share), in place, from a step's
    tally (`_tally`): a saturated share above `threshold` halves μ (down to `min_mu`) and restarts the count; `interval` clean
    steps in a row double it (up to `max_mu`); a set `unless` flag keeps all three. Returns μ."""
    saturated, total = _tally(counts, sizes, flagged)
    if torch.is_tensor(total):
        share = torch.where(total > 0, saturated / total, 0.0)
    elif torch.is_tensor(saturated) and total:
        share = saturated.double() / total
    else:  # plain numbers: no tensor to move to the device
        share = torch.full_like(last_share, saturated / total if total else 0.0)
    over = share > threshold
    counted = torch.where(over, 0, clean + 1)
    grow = counted >= interval
    new_mu = torch.where(over, (mu / 2.0).clamp(min=min_mu), torch.where(grow, (mu * 2.0).clamp(max=max_mu), mu))
    new_clean = torch.where(grow, 0, counted)
    if unless is not None:
        skip = unless != 0
        new_mu, new_clean, share = (
            torch.where(skip, old, new) for old, new in ((mu, new_mu), (clean, new_clean), (last_share, share))
        )
    mu.copy_(new_mu)
    clean.copy_(new_clean)
    # Through a 1-element view: Inductor's CPU kernels (torch 2.13) lose an in-place write to a
    # 0-dim FP64 input (tests/fp8/test_gradients.py holds the compiled path to the eager bits).
    last_share.view(1).copy_(share.view(1))
    return new_mu


def _sum(counts: list[torch.Tensor | int]) -> torch.Tensor | int:
    """Σ counts: one stack and one sum for the tensors (int64, exact in any order)."""
    tensors = [c for c in counts if torch.is_tensor(c)]
    plain = sum(c for c in counts if not torch.is_tensor(c))
    if not tensors:
        return plain
    summed = torch.stack([t.reshape(()) for t in tensors]).sum() if len(tensors) > 1 else tensors[0]
    return summed + plain if plain else summed
