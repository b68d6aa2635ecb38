"""FP8-LM O3: O2 with the FP8 ZeRO distribution of masters and optimizer states (docs/algorithms.md §3).

The FP8 GEMM weights are distributed as whole tensors (`assign_whole_tensors`: largest first,
to the rank with the fewest bytes): the owner keeps the scaled FP16 master and the FP8AdamW
state (E4M3 m, FP16 v, FP8 gradient) of its tensors; every rank keeps the FP8 weight. A step:

1. the FP8 weight gradients are averaged with the shared-scale FP8 all-reduce of O2's DDP
   path (`fp8_allreduce`, μ from the automatic gradient scaler); in one process they are
   quantized per tensor exactly as O2 does;
2. each owner updates its masters with FP8AdamW (the O2 optimizer) and quantizes them to E4M3;
3. the FP8 weights and their scales are all-gathered (as uint8 bytes: gloo has no float8), and
   every other rank stores the FP8 values into its weight, so the next forward quantizes to
   the same FP8 weight on every rank.

The other parameters (LayerNorm, biases, embeddings, LM head) keep FP32 masters and states in
the strategy's client optimizer, which DeepSpeed ZeRO 1/2 partitions as usual; this class only
steps the FP8 part from inside that optimizer's step, so DeepSpeed's ZeRO optimizer is used
as is. In one process, rank 0 owns everything and O3 trains exactly like O2.

Storage note: a rank that does not own a weight keeps its FP8 values in the FP16 parameter
container of the FP8 layer (2 bytes per element, holding FP8 values exactly); the saving is in
the masters, FP8 gradients and optimizer states, which live on the owner only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..deepspeed import assign_whole_tensors
from ..fp8 import fp8_allreduce, quantize_gradient
from ..fp8.linear import E4M3, _quantize_per_tensor
from ..fp8.scaled import dequantize, format_dtype, get_master_scale, pow2_scale, quantize, tensor_amax
from ..numerics import all_finite
from ..optim import FP8AdamW
from ..optim.fp8_adamw import fp8_adamw_param_step
from ..registry import register
from .fp8_lm import FP8LM

__all__ = ["FP8LMO3", "FP8ZeroAdamW"]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class FP8ZeroAdamW(FP8AdamW):
    """The O3 client optimizer: FP8AdamW on the non-FP8 parameters (its groups, which DeepSpeed
    may partition) plus the FP8 ZeRO part for the FP8 GEMM weights, distributed whole.

    Args:
        param_groups: groups of the parameters that are not FP8 GEMM weights (FP32 states).
        fp8_weights: per group, its FP8 GEMM weights (scaled FP16 masters); they follow the
            group's lr and weight_decay, so LR schedulers drive them too.
        margin, exp_avg_sq_format, **hyper: as in FP8AdamW.

    The owned weights' states sit in `self.state` next to the groups' (same keys and dtypes as
    O2); `state_dict` saves them, with the owned masters, under "fp8_zero".
    """

    def __init__(self, param_groups: list[dict[str, Any]], fp8_weights: list[list[torch.Tensor]], **kwargs: Any):
        super().__init__(param_groups, **kwargs)
        self.rank, self.world = _world()
        self.fp8_params = [p for weights in fp8_weights for p in weights]
        self.fp8_sources = [group for weights, group in zip(fp8_weights, self.param_groups) for _ in weights]
        self.owners = assign_whole_tensors([p.numel() for p in self.fp8_params], self.world)
        self.owned = [i for i, owner in enumerate(self.owners) if owner == self.rank]
        self._margin = kwargs.get("margin", 0)
        self._v_dtype = format_dtype(kwargs.get("exp_avg_sq_format", "fp16"))

    def plan_state(self, param: torch.Tensor) -> dict[str, Any]:
        """The state an FP8 weight gets on its owner (memory plans, `hf_lowprec.report`)."""
        return {"exp_avg": torch.empty_like(param, dtype=E4M3, device="meta"), "exp_avg_scale": torch.ones((), device="meta"),
                "exp_avg_sq": torch.empty_like(param, dtype=self._v_dtype, device="meta"),
                "exp_avg_sq_scale": torch.ones((), device="meta")}

    # --- gradients ----------------------------------------------------------------------
    def fp8_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.fp8_params if p.grad is not None]

    def clear_fp8_grads(self) -> None:
        for p in self.fp8_params:
            p.grad = None

    def reduce_fp8_gradients(self, scaler: Any, grad_dtype: torch.dtype) -> None:
        """Average the FP8 weights' gradients over ranks in FP8; each owner keeps its FP8 gradients."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.fp8_params]
        if self.world == 1:
            for i in self.owned:
                payload, scale, saturated = quantize_gradient(grads[i], scaler.mu, grad_dtype, self._margin)
                scaler.record(saturated, grads[i].numel())
                self.set_fp8_grad(self.fp8_params[i], payload, scale)
        elif self.fp8_params:
            numels = [g.numel() for g in grads]
            flat = torch.cat([g.float().reshape(-1) for g in grads])
            result = fp8_allreduce(flat, numels=numels, mu=scaler.mu, fp8_dtype=grad_dtype, margin=self._margin)
            scaler.record(result.stats.overflow, result.stats.numel)
            payloads = result.payload.split(numels)
            for i in self.owned:
                p = self.fp8_params[i]
                self.set_fp8_grad(p, payloads[i].view(p.shape), result.scales[i])
        self.clear_fp8_grads()

    # --- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Owners update their FP8 weights' masters; the groups step; every rank gets every FP8 weight."""
        for i in self.owned:
            p, group = self.fp8_params[i], self.fp8_sources[i]
            state = self.state[p]
            if "grad" not in state or id(p) not in self._pending_grads:
                continue
            if "exp_avg" not in state:
                state.update(step=0, exp_avg=torch.zeros_like(p, dtype=E4M3), exp_avg_scale=torch.ones(()),
                             exp_avg_sq=torch.zeros_like(p, dtype=self._v_dtype), exp_avg_sq_scale=torch.ones(()))
            beta1, beta2 = group["betas"]
            fp8_adamw_param_step(
                p, dequantize(state["grad"], state["grad_scale"]), state, lr=group["lr"], beta1=beta1,
                beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], margin=self._margin,
            )  # fmt: skip
        loss = super().step(closure)  # clears the pending FP8 gradients too
        if self.world > 1 and self.fp8_params:
            self.all_gather_fp8_weights()
        return loss

    def fp8_weight(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(E4M3 payload, scale) of FP8 weight `index`, as the FP8 layer's forward quantizes it."""
        p = self.fp8_params[index]
        return _quantize_per_tensor(p.detach(), E4M3, self._margin, get_master_scale(p))

    @torch.no_grad()
    def all_gather_fp8_weights(self) -> None:
        """Each owner sends its FP8 weights (as bytes) and their scales; the others store them."""
        mine = [self.fp8_weight(i) for i in self.owned]
        per_rank = [sum(p.numel() for p, o in zip(self.fp8_params, self.owners) if o == r) for r in range(self.world)]
        size = max(per_rank)
        send = torch.zeros(size, dtype=torch.uint8)
        offset = 0
        for payload, _ in mine:
            send[offset:offset + payload.numel()] = payload.reshape(-1).view(torch.uint8)
            offset += payload.numel()
        received = torch.empty(size * self.world, dtype=torch.uint8)
        dist.all_gather_into_tensor(received, send)
        scales = torch.zeros(len(self.fp8_params))
        for (_, scale), i in zip(mine, self.owned):
            scales[i] = scale
        dist.all_reduce(scales)  # each scale is nonzero on its owner only
        offsets = [0] * self.world
        for i, (p, owner) in enumerate(zip(self.fp8_params, self.owners)):
            start = owner * size + offsets[owner]
            offsets[owner] += p.numel()
            if owner == self.rank:
                continue
            real = received[start:start + p.numel()].view(E4M3).float().view(p.shape) / scales[i]
            # The FP16 container holds the FP8 values exactly (4-bit significands rescaled by a
            # power of two), so this rank's next forward quantizes them to the same FP8 weight.
            new_scale = pow2_scale(tensor_amax(real), torch.float16, self._margin)
            p.copy_(quantize(real, new_scale, torch.float16))
            get_master_scale(p).copy_(new_scale)

    # --- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        owned = {i: self.state.pop(self.fp8_params[i]) for i in self.owned if self.fp8_params[i] in self.state}
        try:
            state = super().state_dict()
        finally:
            for i, s in owned.items():
                self.state[self.fp8_params[i]] = s
        state["fp8_zero"] = {
            "owners": list(self.owners),
            "masters": {i: (self.fp8_params[i].detach().clone(), get_master_scale(self.fp8_params[i]).clone())
                        for i in self.owned},
            "states": owned,
        }  # fmt: skip
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        ours = state_dict.pop("fp8_zero")
        if list(ours["owners"]) != self.owners:
            raise ValueError(
                f"this FP8 ZeRO state was saved with tensor owners {ours['owners']}, this run assigns "
                f"{self.owners}; resume with the same number of ranks"
            )
        super().load_state_dict(state_dict)
        for i, (payload, scale) in ours["masters"].items():
            self.fp8_params[int(i)].copy_(payload)
            get_master_scale(self.fp8_params[int(i)]).copy_(scale)
        for i, s in ours["states"].items():  # stored in their own dtypes: no cast to the master's
            self.state[self.fp8_params[int(i)]] = dict(s)


@register("fp8-lm-o3", level="O2")
class FP8LMO3(FP8LM):
    """FP8-LM O3: O2 plus the FP8 ZeRO distribution — masters and FP8 optimizer states as whole tensors per rank."""

    zero_stages = (1, 2)
    needs = "DeepSpeed ZeRO stage 1 or 2 across processes"
    zero_refusal = (
        "ZeRO-3 would partition the FP8 layers' weights, which FP8 ZeRO keeps whole per rank with their "
        "scales; use ZeRO stage 1 or 2"
    )
    zero_note = "FP8 weights' masters and FP8AdamW states whole per rank (greedy); other parameters in FP32 partitions"

    def build_optimizer(self, param_groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.Optimizer:
        # The groups (what DeepSpeed partitions) keep the parameters that are not FP8 GEMM
        # weights, with FP32 states as in O2; the FP8 weights go to the FP8 ZeRO part.
        groups = [{**g, "params": [p for p in g["params"] if get_master_scale(p) is None],
                   "exp_avg_format": "fp32", "exp_avg_sq_format": "fp32"} for g in param_groups]  # fmt: skip
        fp8 = [[p for p in g["params"] if get_master_scale(p) is not None] for g in param_groups]
        return FP8ZeroAdamW(
            groups, fp8, **hyper, exp_avg_sq_format=self.options.exp_avg_sq_format, margin=self.options.margin,
            fused=self.options.fused,
        )  # fmt: skip

    def ddp_comm_hook(self) -> None:  # type: ignore[override]
        return None  # FP8ZeroAdamW reduces the FP8 weights' gradients; ZeRO (or DDP) the rest

    def process_gradients(self, optimizer: torch.optim.Optimizer) -> bool:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        ok = torch.tensor(float(all_finite(grads + optimizer.fp8_grads())))
        if optimizer.world > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank skips together
        if not ok:
            optimizer.clear_fp8_grads()
            return False
        optimizer.reduce_fp8_gradients(self.scaler, self.grad_dtype)
        self.scaler.update()
        return True
