"""FP8-LM O3: O2 with the FP8 ZeRO distribution of masters and optimizer states (docs/algorithms.md §3).

The optimizer is `hf_lowprec.optim.zero_fp8.FP8ZeroAdamW` (whole FP8 GEMM weights per rank, FP8
gradient all-reduce, FP8 weight all-gather); this class builds it, decides skipped steps on
every rank together, and gathers the owners' masters for export. In one process, rank 0 owns
everything and O3 trains as O2 (its FP8 weights' gradients quantized in backward, from their GEMMs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..fp8.experts import FP8Experts
from ..fp8.linear import E4M3
from ..fp8.scaled import get_master_scale
from ..optim.zero_fp8 import FP8ZeroAdamW
from .fp8_lm import FP8LM
from .registry import register
from .support import EngineSupport

__all__ = ["FP8LMO3"]


def _fp8_zero(optimizer: Any) -> FP8ZeroAdamW | None:
    from ..memory import unwrap_optimizer

    inner = unwrap_optimizer(optimizer) if optimizer is not None else None
    return inner if isinstance(inner, FP8ZeroAdamW) else None


class _FP8WeightsOf:
    """FP8ZeroAdamW as the owner of its FP8 weights' gradients: the owner setter of
    `hf_lowprec.fp8.gradients.BackwardFP8Gradients` takes the parameters of `param_groups`, where
    FP8ZeroAdamW keeps only the others."""

    def __init__(self, optimizer: FP8ZeroAdamW) -> None:
        self.optimizer = optimizer
        self.param_groups = [{"params": optimizer.fp8_params}]
        self.set_fp8_grad, self.set_fp8_grads = optimizer.set_fp8_grad, optimizer.set_fp8_grads
        self.fp8_grad = optimizer.fp8_grad
        self.fp8_grad_buffers = optimizer.fp8_grad_buffers


@register("fp8-lm-o3", level="O2")
class FP8LMO3(FP8LM):
    """FP8-LM O3: O2 plus the FP8 ZeRO distribution — masters and FP8 optimizer states as whole tensors per rank.

    Memory per rank: the masters (2 bytes), FP8AdamW states (3 bytes) and FP8 gradients (1 byte)
    of the weights it owns, and 1 byte per element for every FP8 weight another rank owns; the
    other parameters keep FP32 masters and states, which DeepSpeed ZeRO 1/2 partitions.
    """

    needs = "DeepSpeed ZeRO stage 1 or 2 across processes"
    support = EngineSupport(
        zero_stages=(1, 2),
        zero_refusal=(
            "ZeRO-3 would partition the FP8 layers' weights, which FP8 ZeRO keeps whole per rank with their "
            "scales; use ZeRO stage 1 or 2"
        ),
        zero_note="FP8 weights' masters and FP8AdamW states whole per rank (greedy); other parameters in FP32 partitions",
        ddp=False,
        ddp_refusal=(
            "FP8 ZeRO reduces and gathers the FP8 weights itself and keeps the weights another rank owns as FP8, "
            "while DDP all-reduces every parameter's gradient and needs them all in one dtype; it runs across "
            "processes under DeepSpeed ZeRO stage 1 or 2. Under DDP use fp8-lm-o2 (the same numerics, FP8 "
            "all-reduce as a DDP hook, no distribution of masters and states)"
        ),
        fsdp2=False,
        fsdp2_refusal=(
            "FP8 ZeRO keeps whole FP8 weights per owning rank, which FSDP2's per-row shards replace; under FSDP2 "
            "train fp8-lm-o2, whose shards hold O3's masters, FP8 moments and FP8 gradients divided by the world "
            "size and all-gather the FP8 weights as E4M3 (fewer bytes per rank than FP8 ZeRO, docs/distributed.md)"
        ),
    )
    # The ranks the FP8 weights are distributed over (None: the world); set it before building
    # the optimizer when the data-parallel group is not the world (DeepSpeed's dp group).
    process_group: dist.ProcessGroup | None = None

    def convert_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """O2's conversion; the FP8 experts take one scale per 3-D weight, since a rank that does
        not own it computes with its FP8 copy, which FP8 ZeRO keeps with one scale per tensor."""
        model = super().convert_model(model)
        for module in model.modules():
            if isinstance(module, FP8Experts):
                module.fp8_tensor_scale = True
        return model

    def build_optimizer(self, param_groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.Optimizer:
        # The groups (what DeepSpeed partitions) keep the parameters that are not FP8 GEMM
        # weights, with FP32 states as in O2 (`unscaled_format`, which a group added later takes
        # too); the FP8 weights go to the FP8 ZeRO part.
        groups = [{**g, "params": [p for p in g["params"] if get_master_scale(p) is None]} for g in param_groups]
        fp8 = [[p for p in g["params"] if get_master_scale(p) is not None] for g in param_groups]
        optimizer = FP8ZeroAdamW(
            groups,
            fp8,
            **hyper,
            exp_avg_sq_format=self.options.exp_avg_sq_format,
            margin=self.options.margin,
            unscaled_format="fp32",
            fused=self.options.fused,
            process_group=self.process_group,
        )
        if optimizer.world == 1:  # the FP8 weights' gradients are quantized in backward, from their GEMMs, as O2's
            self.backward_grads.owner = _FP8WeightsOf(optimizer)
        return optimizer

    def promised_param_dtypes(self) -> tuple[torch.dtype, ...]:
        # Across ranks, the FP8 weights another rank owns are held as their E4M3 payload.
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1
        return super().promised_param_dtypes() + ((E4M3,) if several else ())

    def ddp_comm_hook(self) -> None:  # type: ignore[override]
        return None  # FP8ZeroAdamW reduces the FP8 weights' gradients; ZeRO the rest

    def process_gradients(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Once per step (DeepSpeed calls the optimizer once per group): one skip flag agreed by
        every rank (all-reduce MAX), the FP8 all-reduce and the global clipping coefficient; on
        every call the current groups' gradients are brought to that clipping. The flag is a
        0-dim device tensor (1.0: skip); everything runs whatever it says, so no rank waits for
        the host, and on a skipped step the quantizations do not count towards μ."""
        optimizer.check_attached()
        if not optimizer.begins_step():  # a later group of the same DeepSpeed step
            optimizer.clip_dense_groups()
            self.count_skip(-optimizer.found_inf)  # counted once, on the first call
            return optimizer.found_inf
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        found_inf = self.nonfinite_gradients(grads + optimizer.fp8_grads(), optimizer.device)
        stored = self.backward_grads.nonfinite(optimizer.fp8_params)  # one process: quantized in backward
        if stored is not None:
            found_inf = torch.maximum(found_inf, stored.float())
        if optimizer.world > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=optimizer.process_group)  # every rank skips together
        optimizer.found_inf = found_inf
        optimizer.reduce_fp8_gradients(self.scaler, self.grad_dtype, unless=found_inf)
        self.scaler.update(unless=found_inf)
        optimizer.clip_coefficient()
        optimizer.clip_dense_groups()
        return found_inf

    # --- export ---------------------------------------------------------------------------
    def full_precision_state_dict(
        self, model: torch.nn.Module, optimizer: Any | None = None
    ) -> dict[str, torch.Tensor]:
        """FP32 weights with every FP8 weight's master from its owner (a collective across ranks:
        every rank calls it; see `FP8ZeroAdamW.gather_masters`)."""
        out = super().full_precision_state_dict(model, optimizer)
        return self.exported_state_dict(model, optimizer, out)

    def exported_state_dict(
        self, model: torch.nn.Module, optimizer: Any | None, state_dict: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor] | None:
        """`state_dict` (of `model`) with each FP8 weight replaced by its owner's master in FP32.

        A rank holds only the masters it owns (the FP8 values of the others): the export
        gathers them from their owners. A collective when several ranks run: every rank calls it.
        """
        inner = _fp8_zero(optimizer)
        if inner is None:
            return state_dict
        masters = inner.gather_masters()
        if state_dict is None:
            state_dict = model.state_dict()
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        out = dict(state_dict)
        for i, p in enumerate(inner.fp8_params):
            for name in names.get(id(p), []):
                if name in out:
                    out[name] = masters[i]
        return out
