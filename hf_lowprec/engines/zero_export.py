"""`save_full_precision` under DeepSpeed ZeRO: the FP32 weights the strategy's optimizer holds.

Under ZeRO the optimizer holds the full precision (Collage's θ + δθ, Kahan's compensation, FP32
masters) on DeepSpeed's partitions, each rank its own: `gather_full_precision` takes each
partition's `full_precision_value` and puts every parameter together from the ranks' pieces, bit
for bit, and fp8-lm-o3's FP8 weights as their owners' masters. A collective: every rank calls it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..checkpoints.complete_save import gather_export
from ..memory import unwrap_optimizer
from .zero import partition_segments

__all__ = ["gather_full_precision", "in_full_precision"]


def _groups(zero_optimizer: Any) -> list[tuple[list[torch.Tensor], Any]]:
    """[(the parameters of a group DeepSpeed partitions, its data-parallel group)], the same on every rank."""
    if hasattr(zero_optimizer, "single_partition_of_fp32_groups"):  # ZeRO 1/2
        return [
            (params, zero_optimizer.real_dp_process_group[i]) for i, params in enumerate(zero_optimizer.bit16_groups)
        ]
    if hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):  # ZeRO 3
        return [(params, zero_optimizer.dp_process_group) for params in zero_optimizer.fp16_groups]
    return []


@torch.no_grad()
def gather_full_precision(
    strategy: Any, model: torch.nn.Module, optimizer: Any, zero_optimizer: Any, keep: bool = True
) -> dict[str, torch.Tensor]:
    """{name: FP32 weight} of every parameter DeepSpeed partitions, as the strategy's optimizer holds
    it (`full_precision_value` of the partitions: what `full_precision_state_dict` gives in one
    process), and of every weight the strategy exports from elsewhere (`exported_state_dict`).

    Each element comes from the one rank whose partition holds it: the ranks sum the FP32 bits as
    int32, zeros elsewhere, one parameter at a time. Every rank of the data-parallel group calls
    it; one with `keep` false gets an empty dict (it holds one full parameter at a time)."""
    inner = unwrap_optimizer(zero_optimizer)
    full_value = getattr(inner, "full_precision_value", None)
    pieces: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for part, segments in partition_segments(zero_optimizer):
        flat = (full_value(part) if full_value is not None else part.detach().float()).reshape(-1)
        for param, p_start, q_start, length in segments:
            pieces.setdefault(id(param), []).append((p_start, flat[q_start : q_start + length]))
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for params, group in _groups(zero_optimizer):
        for p in params:
            device = p.ds_tensor.device if hasattr(p, "ds_tensor") else p.device
            bits = torch.zeros(getattr(p, "ds_numel", p.numel()), dtype=torch.int32, device=device)
            for start, piece in pieces.get(id(p), ()):
                bits[start : start + piece.numel()] = piece.view(torch.int32)
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(bits, group=group)  # one rank's bits per element, zeros elsewhere
            if keep:
                value = (
                    bits.view(torch.float32).view(getattr(p, "ds_shape", p.shape)).cpu()
                )  # off the GPU, one at a time
                out.update(dict.fromkeys(names.get(id(p), ()), value))
    exported = gather_export(strategy, model, optimizer)  # fp8-lm-o3's masters (a collective too)
    if keep:
        out.update({name: value.float() for name, value in exported.items() if value is not None})
    return out


def in_full_precision(
    state_dict: dict[str, torch.Tensor], gathered: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`state_dict` (DeepSpeed's, of the 16-bit model) with `gather_full_precision`'s weights in
    place and every other floating tensor as an FP32 copy, as `full_precision_state_dict` has them."""
    return {
        key: gathered[key] if key in gathered else value.float() if value.is_floating_point() else value
        for key, value in state_dict.items()
    }
