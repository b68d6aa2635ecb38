"""FP8 ZeRO: FP8AdamW with the FP8 GEMM weights distributed whole over ranks (FP8-LM O3; docs/algorithms.md §3).

`FP8ZeroAdamW` runs in one process, under DDP and as DeepSpeed ZeRO 1/2's client optimizer: each
FP8 GEMM weight's master and FP8AdamW state live on one owning rank, every other rank keeps the
FP8 weight alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..checkpoints.resume import check_zero_owners
from ..compiling import takes_gpu_path
from ..fp8 import all_gather_owned_fp8, fp8_allreduce, quantize_gradient
from ..fp8.fused import gradients_cast_into
from ..fp8.linear import E4M3, quantize_weight, set_grad_sink
from ..fp8.scaled import dequantize, format_dtype, get_master_scale
from ..fp8.stored_sums import mask_skipped_stored, sum_of_stored_squares
from ..partition import assign_whole_tensors
from .fp8_adamw import FP8AdamW

__all__ = ["FP8ZeroAdamW"]

# The eps of DeepSpeed's and torch's clipping: c = C / (‖g‖ + 1e-6).
_CLIP_EPS = 1e-6


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    on = dist.is_available() and dist.is_initialized()
    return (dist.get_rank(group), dist.get_world_size(group)) if on else (0, 1)


def _first_param(group: dict[str, Any]) -> Any:
    # A group is recognised by its first parameter (DeepSpeed's flat partition): the tensors
    # stay when `load_state_dict` replaces the group dicts.
    return group["params"][0] if group["params"] else group


class FP8ZeroAdamW(FP8AdamW):
    """The O3 client optimizer: FP8AdamW on the non-FP8 parameters (its groups, which DeepSpeed
    may partition) plus the FP8 ZeRO part for the FP8 GEMM weights, distributed whole.

    Args:
        param_groups: groups of the parameters that are not FP8 GEMM weights (FP32 states).
        fp8_weights: per group, its FP8 GEMM weights (scaled FP16 masters); they follow the
            group's lr and weight_decay, so LR schedulers drive them too.
        process_group: the data-parallel ranks the FP8 weights are distributed over (default:
            the world; under DeepSpeed, its data-parallel group).
        margin, exp_avg_sq_format, **hyper: as in FP8AdamW.

    The owned weights' states sit in `self.state` next to the groups' (same keys and dtypes as
    O2); `state_dict` saves them, with the owned masters, under "fp8_zero".

    The FP8 GEMM weights are distributed as whole tensors (`hf_lowprec.partition.assign_whole_tensors`:
    largest first, to the rank with the fewest bytes). Per weight, its owner keeps the scaled FP16
    master and the FP8AdamW state (E4M3 m, FP16 v, FP8 gradient); every other rank keeps only the
    FP8 weight, stored in the parameter itself as its E4M3 payload (1 byte per element) with the
    FP8 scale in the layer's `master_scale` (`hf_lowprec.fp8.linear`). A step:

    1. the FP8 weight gradients are averaged with the shared-scale FP8 all-reduce
       (`fp8_allreduce`, μ from the automatic gradient scaler); a rank that does not own a weight
       collects its gradient through the layer's gradient sink (FP16, as `p.grad` would be); in
       one process they are quantized per tensor exactly as O2 does;
    2. gradient clipping over every gradient (`clip_coefficient`): under DeepSpeed ZeRO the norm
       of the partitioned gradients (DeepSpeed's) and of the FP8 gradients (summed over owners)
       give one coefficient c = min(1, C / (‖g‖ + 1e-6)), C = `gradient_clipping`;
    3. each owner updates its masters with FP8AdamW and quantizes them to E4M3;
    4. the FP8 weights and their scales are all-gathered (`all_gather_owned_fp8`, 1 byte per
       element on the wire) and every other rank stores them as they are.

    Under DeepSpeed ZeRO 1/2 its groups hold the other parameters, which DeepSpeed partitions; it
    calls `step()` once per group, and the FP8 part runs on the call with the first group
    (`engines.zero.attach_zero_optimizer` tells it the groups and DeepSpeed's optimizer). Every
    tensor a collective touches is created on the parameters' device.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        fp8_weights: list[list[torch.Tensor]],
        *,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(param_groups, **kwargs)
        self.process_group = process_group
        self.rank, self.world = _world(process_group)
        self.fp8_params = [p for weights in fp8_weights for p in weights]
        # Each FP8 weight follows the group it came with, by index: `load_state_dict` (DeepSpeed's
        # resume) replaces the group dicts, and an LR scheduler writes into the current ones.
        self._fp8_group = [index for index, weights in enumerate(fp8_weights) for _ in weights]
        self.owners = assign_whole_tensors([p.numel() for p in self.fp8_params], self.world)
        self.owned = [i for i, owner in enumerate(self.owners) if owner == self.rank]
        self._margin = kwargs.get("margin", 0)
        self._v_dtype = format_dtype(kwargs.get("exp_avg_sq_format", "fp16"))
        # Gradients of the weights another rank owns, collected by the layers' gradient sinks
        # in the masters' dtype (what `p.grad` would hold), until the FP8 all-reduce.
        self._grad_dtype = {i: p.dtype for i, p in enumerate(self.fp8_params)}
        self._sunk: dict[int, torch.Tensor] = {}
        for i, owner in enumerate(self.owners):
            if owner != self.rank:
                set_grad_sink(self.fp8_params[i], self._sink(i))
        # Set by `attach_zero`: DeepSpeed's ZeRO optimizer and the full list of groups.
        self.zero_optimizer: Any = None
        self._all_groups: list[dict[str, Any]] | None = None
        # This step's skip flag (a 0-dim device tensor, 1.0: skip), taken on its first call and kept
        # for the other groups; the dense groups' clipping factor (a device tensor once clipping runs).
        self.found_inf: torch.Tensor | None = None
        self._dense_factor: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """The parameters' device: where every tensor of a collective lives (NCCL or gloo)."""
        for p in self.fp8_params:
            return p.device
        for group in self.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def plan_state(self, param: torch.Tensor, group: dict[str, Any] | None = None) -> dict[str, Any]:
        """The state an FP8 weight gets on its owner (memory plans, `hf_lowprec.report`); a
        parameter of the groups gets FP8AdamW's."""
        if group is not None or not any(param is p for p in self.fp8_params):
            return super().plan_state(param, group)
        return {
            "exp_avg": torch.empty_like(param, dtype=E4M3, device="meta"),
            "exp_avg_scale": torch.ones((), device="meta"),
            "exp_avg_sq": torch.empty_like(param, dtype=self._v_dtype, device="meta"),
            "exp_avg_sq_scale": torch.ones((), device="meta"),
        }

    # --- DeepSpeed ----------------------------------------------------------------------
    def attach_zero(self, zero_optimizer: Any) -> None:
        """Run under DeepSpeed ZeRO `zero_optimizer` (whose client this optimizer is).

        Records the full list of groups (DeepSpeed steps them one call each) and the ZeRO
        optimizer (its gradient norm and `clip_grad`), and stores the weights other ranks own
        as FP8 from now on (after `deepspeed.initialize`, whose broadcast of the model needs
        every rank's parameters in one dtype).

        The FP8 weights lie outside DeepSpeed's groups, so its `zero_grad` would not reach their
        gradients: it is extended to drop them too. A step DeepSpeed skips (a non-finite dense
        gradient in its norm) never calls this optimizer but ends in that `zero_grad`, so the
        skipped batch's FP8 gradients are not added into the next step's."""
        dp_group = getattr(zero_optimizer, "dp_process_group", None)
        if dp_group is not None and dist.get_world_size(dp_group) != self.world:
            raise ValueError(
                f"DeepSpeed's data-parallel group has {dist.get_world_size(dp_group)} ranks, but the FP8 weights "
                f"were distributed over {self.world}; build the strategy's optimizer with process_group= that group"
            )
        self.zero_optimizer = zero_optimizer
        self._all_groups = list(self.param_groups)
        self.store_non_owned_as_fp8()
        dense_zero_grad = getattr(zero_optimizer, "zero_grad", None)
        if dense_zero_grad is not None and not getattr(zero_optimizer, "_hf_lowprec_drops_fp8_grads", False):

            def zero_grad(*args: Any, **kwargs: Any) -> Any:
                self.clear_fp8_grads()
                return dense_zero_grad(*args, **kwargs)

            zero_optimizer.zero_grad = zero_grad
            zero_optimizer._hf_lowprec_drops_fp8_grads = True

    def begins_step(self) -> bool:
        """True on the call of `step()` that starts an optimizer step: always, except on the
        calls DeepSpeed makes for its second and later groups."""
        groups = self._all_groups
        if groups is None or not groups or not self.param_groups:
            return True
        return _first_param(self.param_groups[0]) is _first_param(groups[0])

    def _full_groups(self) -> list[dict[str, Any]]:
        """Every group, also during DeepSpeed's one-group calls."""
        return self._all_groups if self._all_groups is not None else self.param_groups

    @property
    def fp8_sources(self) -> list[dict[str, Any]]:
        """The group (lr, betas, weight_decay) each FP8 weight follows."""
        groups = self._full_groups()
        return [groups[index] for index in self._fp8_group]

    def check_attached(self) -> None:
        """Across ranks the FP8 part needs DeepSpeed's ZeRO optimizer (`attach_zero`): raise, naming the call."""
        if self.world > 1 and self.zero_optimizer is None:
            raise RuntimeError(
                "fp8-lm-o3 across processes runs under DeepSpeed ZeRO stage 1 or 2: call "
                "hf_lowprec.engines.zero.attach_zero_optimizer(engine.optimizer) after "
                "deepspeed.initialize (the Trainer and Accelerate's PrecisionPlugin do)"
            )

    # --- gradients ----------------------------------------------------------------------
    def _sink(self, index: int) -> Any:
        def sink(grad: torch.Tensor) -> None:
            grad = grad.to(self._grad_dtype[index])
            held = self._sunk.get(index)
            if held is None:
                self._sunk[index] = grad
            else:
                held.add_(grad)  # micro-batch accumulation, rounded as autograd's would be

        return sink

    def _local_grad(self, index: int) -> torch.Tensor | None:
        p = self.fp8_params[index]
        return p.grad if p.grad is not None else self._sunk.get(index)

    def fp8_grads(self) -> list[torch.Tensor]:
        """This rank's local FP8 weights' gradients before the all-reduce (for the finite check)."""
        return [g for g in (self._local_grad(i) for i in range(len(self.fp8_params))) if g is not None]

    def clear_fp8_grads(self) -> None:
        for p in self.fp8_params:
            p.grad = None
        self._sunk.clear()

    def reduce_fp8_gradients(self, scaler: Any, grad_dtype: torch.dtype, unless: torch.Tensor | None = None) -> None:
        """Average the FP8 weights' gradients over ranks in FP8; each owner keeps its FP8 gradients.

        `unless`: the step's skip flag (0-dim device tensor); where set, the counts do not go into
        μ and the kept FP8 gradients are zeroed (no NaN stays in the state), on the device."""
        # A frozen weight (`requires_grad`, alike on every rank) takes no step; in one process neither does one
        # without a gradient (as in torch.optim); across ranks that one is reduced as zeros and stepped, as DeepSpeed's.
        local = {i: self._local_grad(i) for i, p in enumerate(self.fp8_params) if p.requires_grad}
        # One process quantizes per tensor (True: a skipped step's gradients were zeroed there).
        zeroed = self.world == 1 and self._quantize_owned(local, scaler, grad_dtype, unless)
        if self.world > 1 and local:
            indices, numels = list(local), [self.fp8_params[i].numel() for i in local]
            # One concatenation, widened once (exact, as widening each was: one launch per weight).
            flat = torch.cat([torch.zeros(n, dtype=self._grad_dtype[i], device=self.device) if g is None
                              else g.reshape(-1) for (i, g), n in zip(local.items(), numels)]).float()  # fmt: skip
            mu, group = scaler.mu_for(flat), self.process_group
            result = fp8_allreduce(flat, numels=numels, mu=mu, fp8_dtype=grad_dtype, margin=self._margin, group=group)
            scaler.record(result.stats.overflow, result.stats.numel, unless=unless)
            # The owned gradients into the optimizer's buffers in a few launches (`set_fp8_grads`), not two per weight.
            mine = [(i, payload, scale) for i, payload, scale in
                    zip(indices, result.payload.split(numels), result.scales.unbind(), strict=True)
                    if self.owners[i] == self.rank]  # fmt: skip
            params = [self.fp8_params[i] for i, _, _ in mine]
            self.set_fp8_grads(params, [m[1].view(p.shape) for m, p in zip(mine, params)], [m[2] for m in mine])
        if unless is not None and not zeroed:
            mask_skipped_stored(self._owned_stored(), unless)
        self.clear_fp8_grads()

    def _quantize_owned(
        self, grads: dict[int, torch.Tensor], scaler: Any, grad_dtype: torch.dtype, unless: torch.Tensor | None
    ) -> bool:
        """Each owned gradient (by index; None: none this step, no step) quantized as O2 does, into the optimizer's
        buffers; on a GPU, once they exist, in one graph with a skipped step's zeroing (`gradients_cast_into`)."""
        owned = [i for i in self.owned if grads.get(i) is not None]
        gpu = bool(owned) and takes_gpu_path(grads[owned[0]].device)
        buffers = [self.fp8_grad_buffers(self.fp8_params[i], grad_dtype) for i in owned] if gpu else [None]
        mus = [scaler.mu_for(grads[i]) for i in owned]
        if None not in buffers:
            counts = gradients_cast_into([grads[i] for i in owned], mus, grad_dtype, self._margin, buffers, unless)
        else:
            counts = []
            for i, mu in zip(owned, mus):
                payload, scale, saturated = quantize_gradient(grads[i], mu, grad_dtype, self._margin)
                self.set_fp8_grad(self.fp8_params[i], payload, scale)
                counts.append(saturated)
        for i, saturated in zip(owned, counts):
            scaler.record(saturated, grads[i].numel(), unless=unless)
        return None not in buffers

    def _owned_stored(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The FP8 gradients (payload, scale) this rank holds, in its owned weights' order."""
        return [g for g in (self.fp8_grad(self.fp8_params[i]) for i in self.owned) if g is not None]

    def clip_coefficient(self) -> torch.Tensor | None:
        """Once per step, after `reduce_fp8_gradients`: the global norm of every gradient and the
        clipping of the FP8 ones; None outside DeepSpeed (one process clips `p.grad` as usual).

        ‖g‖² = ‖dense‖² + Σ_owners ‖FP8‖². ‖dense‖ is DeepSpeed's norm of its partitioned
        gradients (before its clipping); the FP8 sum is one all-reduce. With C =
        `gradient_clipping` > 0 the coefficient is c = 1/max(1, (‖g‖ + 1e-6)/C), DeepSpeed's
        formula; the FP8 gradients take it by dividing their scales (payloads untouched) and
        the dense groups, which DeepSpeed clipped by its own c_d from ‖dense‖ alone, are
        multiplied by c/c_d in `clip_dense_groups`. DeepSpeed's reported norm becomes ‖g‖.
        """
        zero = self.zero_optimizer
        self._dense_factor = None
        if zero is None:
            return None
        dense = getattr(zero, "_global_grad_norm", None)
        dense = torch.as_tensor(0.0 if dense is None else dense, dtype=torch.float32, device=self.device).reshape(())
        stored = self._owned_stored()
        squares = sum_of_stored_squares(stored, self.device)
        if self.world > 1:
            dist.all_reduce(squares, group=self.process_group)
        total = (dense.square() + squares).sqrt()
        zero._global_grad_norm = total
        max_norm = float(getattr(zero, "clip_grad", 0.0) or 0.0)
        if max_norm > 0:
            # A non-finite norm clips nothing (factors 1, exact): decided on the device.
            finite = torch.isfinite(total)
            ours = torch.where(finite, torch.clamp((total + _CLIP_EPS) / max_norm, min=1.0), 1.0)
            theirs = torch.where(finite, torch.clamp((dense + _CLIP_EPS) / max_norm, min=1.0), 1.0)
            if stored:  # real = payload / scale: each gradient divided by `ours`
                torch._foreach_mul_([scale for _, scale in stored], ours)
            self._dense_factor = theirs / ours
        return total

    def clip_dense_groups(self) -> None:
        """Bring the current groups' gradients (DeepSpeed's partitions) to the global clipping."""
        factor = self._dense_factor
        if factor is not None:  # a factor of 1 multiplies exactly
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(factor)

    # --- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None, *, found_inf: torch.Tensor | None = None) -> Any:
        """Owners update their FP8 weights' masters; the groups step; every rank gets every FP8 weight.

        `found_inf` as `adamw.AdamW.step` (a 0-dim device flag, nonzero: nothing changes). The FP8 part
        runs whatever it says: a skipped update leaves each master as it was, and the all-gather
        then hands every rank the FP8 weights it already holds."""
        self.check_attached()
        if self.begins_step():
            self._step_owned_fp8_weights(found_inf)
            self._pending_grads.difference_update(id(self.fp8_params[i]) for i in self.owned)
            if self.world > 1 and self.fp8_params:
                self.all_gather_fp8_weights()
        if found_inf is None:
            return super().step(closure)
        return super().step(closure, found_inf=found_inf)

    def _step_owned_fp8_weights(self, found_inf: torch.Tensor | None = None) -> None:
        """FP8AdamW on the FP8 weights this rank owns and holds a gradient for, through the same
        buckets (and fast paths) as the groups' parameters: each weight with the formats of the
        optimizer's defaults (E4M3 m, FP16 v, scaled master) and the lr, betas and weight decay
        of the group it came with; its FP8 gradient is the (payload, scale) handed over."""
        groups = self._full_groups()
        buckets: dict[tuple[int, Any, torch.device], list[tuple]] = {}
        for i in self.owned:
            p = self.fp8_params[i]
            if id(p) not in self._pending_grads:
                continue
            options = self._options_of(p)  # the defaults: the FP8 weights are outside the groups
            composition = self.composition(p, options)
            local, state = p.detach(), self.state[p]
            if "step" not in state:  # the state holds only the handed-over gradient so far
                state.update({k: v for k, v in self.plan_state(p, options).items() if k not in state})
            self._complete_state(p, local, state, composition)
            key = (self._fp8_group[i], composition, local.device)
            buckets.setdefault(key, []).append((p, local, self._gradient(p), state))
        for (index, composition, device), items in buckets.items():
            if found_inf is None:
                self._step_bucket(index, groups[index], composition, device, items)
            else:
                self._step_bucket(index, groups[index], composition, device, items, found_inf.reshape(()).to(device))

    def fp8_weight(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(E4M3 payload, scale) of FP8 weight `index`, as the FP8 layer's forward quantizes it."""
        p = self.fp8_params[index]
        if p.dtype == E4M3:
            return p.detach(), get_master_scale(p)
        return quantize_weight(p.detach(), self._margin, get_master_scale(p))

    @torch.no_grad()
    def _store_fp8(self, index: int, payload: torch.Tensor, scale: torch.Tensor) -> None:
        p = self.fp8_params[index]
        if p.dtype != E4M3:
            p.data = torch.empty(p.shape, dtype=E4M3, device=p.device)  # frees the FP16 copy
        p.copy_(payload.view(p.shape))
        get_master_scale(p).copy_(scale)

    @torch.no_grad()
    def store_non_owned_as_fp8(self) -> None:
        """Keep each weight another rank owns as its FP8 weight (1 byte per element) from now on.

        The FP8 weight is computed here from this rank's copy, which equals the owner's master
        (data-parallel ranks start from one model), as the owner's forward computes it."""
        for i, owner in enumerate(self.owners):
            if owner != self.rank and self.fp8_params[i].dtype != E4M3:
                self._store_fp8(i, *self.fp8_weight(i))

    @torch.no_grad()
    def all_gather_fp8_weights(self) -> None:
        """Each owner sends its FP8 weights (as bytes) and their scales; the others store them."""
        mine = [(i, *self.fp8_weight(i)) for i in self.owned]
        payloads, scales = all_gather_owned_fp8(
            mine, [p.numel() for p in self.fp8_params], self.owners, device=self.device, group=self.process_group
        )
        for i, owner in enumerate(self.owners):
            if owner != self.rank:
                self._store_fp8(i, payloads[i], scales[i])

    @torch.no_grad()
    def gather_masters(self) -> dict[int, torch.Tensor]:
        """Every FP8 weight's master in real units (FP32), from its owner; a collective.

        Every rank must call it (export runs on every rank under DeepSpeed). Each owner
        broadcasts its FP16 payload and FP32 scale; real = payload / scale is rounded once
        (FP16 payloads and power-of-two scales: exact in FP32 unless below FP32's normals)."""
        out = {}
        for i, (p, owner) in enumerate(zip(self.fp8_params, self.owners, strict=True)):
            if owner == self.rank:
                payload, scale = p.detach(), get_master_scale(p).detach().float().reshape(())
            else:
                payload = torch.empty(p.shape, dtype=self._grad_dtype[i], device=p.device)
                scale = torch.empty((), dtype=torch.float32, device=p.device)
            if self.world > 1:
                payload = payload.contiguous()
                src = dist.get_global_rank(self.process_group, owner) if self.process_group is not None else owner
                dist.broadcast(payload, src=src, group=self.process_group)
                dist.broadcast(scale, src=src, group=self.process_group)
            out[i] = dequantize(payload, scale, torch.float32)
        return out

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
            "masters": {
                i: (self.fp8_params[i].detach().clone(), get_master_scale(self.fp8_params[i]).clone())
                for i in self.owned
            },
            "states": owned,
        }
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        ours = state_dict.pop("fp8_zero")
        check_zero_owners(ours["owners"], self.owners)  # another number of ranks: refused
        super().load_state_dict(state_dict)  # new group dicts: the full list is this one now
        if self._all_groups is not None:
            self._all_groups = list(self.param_groups)
        for i, (payload, scale) in ours["masters"].items():
            self.fp8_params[int(i)].copy_(payload)
            get_master_scale(self.fp8_params[int(i)]).copy_(scale)
        for i, s in ours["states"].items():  # stored in their own dtypes: no cast to the master's
            self.state[self.fp8_params[int(i)]] = dict(s)
