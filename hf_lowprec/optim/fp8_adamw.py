"""FP8 AdamW, the low-bit optimizer of FP8-LM / MS-AMP O2 (FP8-LM §2.2; docs/algorithms.md §3):
`FP8AdamW`, a composition of the AdamW core with m in E4M3 and v in FP16, each with a per-tensor
power-of-two scale, and the FP8 GEMM weights' scaled FP16 masters updated in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch

from ..compiling import takes_gpu_path
from ..distributed import local_shard as _local
from ..distributed import sharded_like as _sharded_like
from ..fp8.scaled import FORMATS, format_dtype, get_fp8_weight_copy, get_master_scale, set_fp8_weight_copy
from .adamw import AdamW, Composition, adamw_scalars
from .dispatch import FusedMode
from .formats import Scaled
from .rules import Nearest, ScaledMaster, ScaledMasterFP8

__all__ = ["FP8AdamW", "fp8_adamw_param_step", "merge_split_groups", "merge_split_schedule", "split_group_counts"]


def _composition(param: torch.Tensor, group: dict[str, Any]) -> Composition:
    margin = group["margin"]
    m = Scaled(format_dtype(group["exp_avg_format"]), margin)
    # keep_nonzero: a small v beside a far larger one in the tensor stored as 0 made the update m/ε.
    v = Scaled(format_dtype(group["exp_avg_sq_format"]), margin, keep_nonzero=True)
    if get_master_scale(param) is None:
        if group.get("unscaled_format") is not None:  # not an FP8 GEMM weight: its own format
            m = Scaled(format_dtype(group["unscaled_format"]), margin)
            v = Scaled(m.dtype, margin, keep_nonzero=True)
        return Composition(m, v, Nearest())
    if not takes_gpu_path(param.device):  # the native kernels' rule
        return Composition(m, v, ScaledMaster(margin))
    # A GPU's: one rule for every scaled master, the FP8 layers' weights written where linked.
    copy = get_fp8_weight_copy(param)
    return Composition(m, v, ScaledMasterFP8(margin, weight_margin=margin if copy is None else copy.margin))


def fp8_adamw_param_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    margin: int,
    exp_avg_format: str | None = None,
    exp_avg_sq_format: str | None = None,
) -> torch.Tensor:
    """One FP8AdamW step of one parameter outside an optimizer (the reference), in place.

    Args:
        param: the master weight (real values, or an FP16 payload with `get_master_scale`).
        grad: the gradient with respect to the real weight.
        state: "step", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"; the
            formats are read from the payloads' dtypes unless given.

    Returns:
        The update Δθ in real units (FP32), for the lost-arithmetic metrics.
    """
    names = {dtype: name for name, dtype in FORMATS.items()}
    group = dict(
        margin=margin,
        exp_avg_format=exp_avg_format or names[state["exp_avg"].dtype],
        exp_avg_sq_format=exp_avg_sq_format or names[state["exp_avg_sq"].dtype],
    )
    composition = _composition(param, group)
    state["step"] += 1
    scalars = torch.tensor(
        adamw_scalars(state["step"], lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay),
        dtype=torch.float32,
        device=param.device,
    )
    stored = composition.stored(param, state)
    flat = [param.detach().view(-1), grad.detach().reshape(-1), None]
    flat += [t.view(-1) if t is not None and t.dim() else t for t in stored]
    return composition.step(*flat, scalars, None).view(param.shape)


class FP8AdamW(AdamW):
    """AdamW with an E4M3 first moment and a scaled FP16 second moment (MS-AMP O2 "LBAdamW").

    Args:
        params: parameters or parameter groups (any floating dtype; FP16 for O2 masters).
        lr, betas, eps, weight_decay: as in `torch.optim.AdamW` (decoupled weight decay).
        exp_avg_format: storage of m: "e4m3" (paper), "e5m2", "fp16", "bf16" or "fp32".
        exp_avg_sq_format: storage of v: "fp16" (paper), or "e4m3"/"e5m2" for the
            FP8-second-moment ablation (FP8-LM Fig. 8 #4), "bf16", "fp32".
        margin: scale margin in binades for moments and scaled masters.
        unscaled_format: storage of m and v of the parameters without a master scale (not FP8
            GEMM weights: norms, biases, embeddings), e.g. "fp32" as FP8-LM O2 keeps them;
            None: `exp_avg_format` and `exp_avg_sq_format` as for the others.
        fused: as `AdamW` ("auto", "native", "compiled", "reference"; same bits).

    Per parameter θ with gradient g, step t, all arithmetic in FP32:

        m ← β1·m + (1 − β1)·g                stored as E4M3 payload + FP32 per-tensor scale
        v ← β2·v + (1 − β2)·g²               stored as FP16 payload + FP32 per-tensor scale
        θ ← θ − lr·( m̂ / (√v̂ + ε) + λ·θ )    m̂ = m/(1 − β1ᵗ), v̂ = v/(1 − β2ᵗ)

    Every scale is the power of two of `hf_lowprec.fp8.scaled` (real = payload / s), recomputed
    from the new amax at each step (`formats.Scaled`). The first moment tolerates FP8 ("the
    direction of the gradient matters more than its magnitude"); the second moment does not:
    squares of small gradients underflow, and FP8 v makes training diverge (FP8-LM Fig. 8, #4).
    The scales need the amax of the new values before anything is stored: the compiled step
    reduces, then stores in a second loop over the same registers (Inductor recomputes the cheap
    element-wise update rather than writing FP32 copies).

    Master weights are the parameters themselves, in their own dtype: for the FP8 GEMM weights
    of FP8-LM O2, an FP16 payload with a per-tensor scale (`get_master_scale`, set by
    `fp8.linear.FP8Linear.scale_master_weight`), updated in place (`rules.ScaledMaster`; the
    others take `rules.Nearest`). Those cost 2 (master) + 1 (FP8 gradient) + 1 (m) + 2 (v) = 6
    bytes per parameter, plus a few scalars per tensor. The storage formats are per parameter
    group, and `unscaled_format` gives the parameters that are not FP8 GEMM weights (LayerNorm
    gains, biases, embeddings) their own in the same groups: FP32 masters and FP32 moments
    (stored unscaled), as MS-AMP keeps them, in the user's groups as given. The lost-arithmetic metrics see the master in real units (`held_value`).
    Where the FP8 layer runs eagerly on a GPU it links its E4M3 weight to the master
    (`fp8.scaled.FP8WeightCopy`), and the step writes the next one in the loop that stores the
    master (`rules.ScaledMasterFP8`), so the layer's forward casts no weight.

    State per parameter: "step" (int), "exp_avg" + "exp_avg_scale", "exp_avg_sq" +
    "exp_avg_sq_scale" (payloads + FP32 scalars), and, once `set_fp8_grad` was used, "grad" +
    "grad_scale": the FP8 gradient buffer, reused every step. It is saved with the state (one
    byte per element) so that a loaded state has the same keys and dtypes; a loaded gradient
    is never applied, since only `set_fp8_grad` marks a gradient as this step's.

    Gradients: `p.grad` (any dtype), or an FP8 gradient handed over with `set_fp8_grad`,
    which takes precedence and lets the caller free `p.grad` (1 byte per element instead of 2–4).
    """

    param_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    extra_options: ClassVar[tuple[str, ...]] = ("exp_avg_format", "exp_avg_sq_format", "margin", "unscaled_format")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        exp_avg_format: str = "e4m3",
        exp_avg_sq_format: str = "fp16",
        margin: int = 0,
        unscaled_format: str | None = None,
        fused: FusedMode = "auto",
        **torch_arguments: Any,
    ) -> None:
        self._pending_grads: set[int] = set()
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            fused=fused,
            exp_avg_format=exp_avg_format,
            exp_avg_sq_format=exp_avg_sq_format,
            margin=margin,
            unscaled_format=unscaled_format,
            **torch_arguments,
        )

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        for key in ("exp_avg_format", "exp_avg_sq_format", "unscaled_format"):
            if key == "unscaled_format" and group.get(key) is None:
                continue
            if group[key] not in FORMATS:
                raise ValueError(f"FP8AdamW: {key} must be one of {sorted(FORMATS)}, got {group[key]!r}")
        margin = group["margin"]
        if not (isinstance(margin, int) and not isinstance(margin, bool) and margin >= 0):
            raise ValueError(f"FP8AdamW: margin must be an integer >= 0, got {margin!r}")

    def composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        return _composition(param, group)

    def planned_grad_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype `param`'s gradient is held in between steps (memory plans): FP8 for a scaled
        FP16 master, whose gradient the strategy hands over with `set_fp8_grad`; else `param`'s."""
        return torch.float8_e4m3fn if get_master_scale(param) is not None else param.dtype

    def set_fp8_grad(self, param: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor) -> None:
        """Hand over this step's gradient of `param` as FP8 payload / scale (real = payload / scale).

        The payload is copied into a buffer kept in the optimizer state (role "gradient"), so
        the caller can free `p.grad`. It is used by the next `step()` and then discarded.
        """
        shard = _local(param)  # FSDP2: the gradient of this rank's shard
        if payload.shape != shard.shape:
            raise ValueError(f"FP8 gradient shape {tuple(payload.shape)} != parameter shape {tuple(shard.shape)}")
        state = self.state[param]
        buffer = state.get("grad")
        if buffer is None or buffer.dtype != payload.dtype:
            state["grad"] = _sharded_like(payload.detach().clone(), param)
            state["grad_scale"] = scale.detach().float().clone()
        else:
            _local(buffer).copy_(payload)
            state["grad_scale"].copy_(scale)
        self._pending_grads.add(id(param))

    def set_fp8_grads(
        self, params: Sequence[torch.Tensor], payloads: Sequence[torch.Tensor], scales: Sequence[torch.Tensor]
    ) -> None:
        """`set_fp8_grad` of each (param, payload, scale) in a constant number of launches whatever
        their number, once the buffers exist: one multi-tensor copy of the payloads' bytes, one of the
        scales (DDP's FP8 all-reduce hands a bucket's gradients over this way; a copy per tensor was
        two launches per weight). A parameter without its buffers yet (the first step) takes
        `set_fp8_grad`."""
        into: list[torch.Tensor] = []
        taken: list[torch.Tensor] = []
        for param, payload, scale in zip(params, payloads, scales, strict=True):
            buffers = self.fp8_grad_buffers(param, payload.dtype) if payload.shape == _local(param).shape else None
            if buffers is None:
                self.set_fp8_grad(param, payload, scale)  # makes the buffers, or names what is wrong
                continue
            into += [buffers[0].view(torch.uint8), buffers[1]]
            taken += [payload.view(torch.uint8), scale.reshape(buffers[1].shape)]
        if into:  # the bytes: FP8 has no arithmetic here
            torch._foreach_copy_(into[0::2], taken[0::2])
            torch._foreach_copy_(into[1::2], taken[1::2])

    def fp8_grad_buffers(self, param: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The state buffers (payload of `dtype`, FP32 scale) that this step's FP8 gradient of
        `param` is written into in place, marked as handed over; None before `set_fp8_grad` has
        made them (the first step) or when they hold another format. Writing into them in the
        graph that casts the gradient spares the two copies `set_fp8_grad` launches."""
        state = self.state[param]
        buffer = state.get("grad")
        if buffer is None or buffer.dtype != dtype:
            return None
        local = _local(buffer)
        if local.shape != _local(param).shape or not local.is_contiguous():
            return None  # `set_fp8_grad` checks and copies
        self._pending_grads.add(id(param))
        return local, state["grad_scale"]

    def fp8_grad(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's FP8 gradient of `param` as the stored (payload, scale), or None.

        The tensors are the optimizer's own: dividing the scale by c in place multiplies the
        gradient by c without touching the payload (how FP8-LM O2 clips).
        """
        if id(param) not in self._pending_grads:
            return None
        state = self.state[param]
        return _local(state["grad"]), state["grad_scale"]

    def _gradient(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if id(param) in self._pending_grads:
            state = self.state[param]
            return _local(state["grad"]), state["grad_scale"]
        return super()._gradient(param)

    def _step_bucket(self, group_index, group, composition, device, items, found_inf=None) -> None:
        if not isinstance(composition.rule, ScaledMasterFP8):
            return super()._step_bucket(group_index, group, composition, device, items, found_inf)
        for param, *_ in items:
            copy = get_fp8_weight_copy(param)
            if copy is not None and not (copy.used and copy.holds(param)):
                # Not the cast of the master as it is now (written since), or no forward took it
                # since the last step (the model runs compiled now): not written, let go.
                set_fp8_weight_copy(param, None)
        super()._step_bucket(group_index, group, composition, device, items, found_inf)
        for param, *_ in items:  # the layers take these at their next forward (`fp8.linear`)
            copy = get_fp8_weight_copy(param)
            if copy is not None:
                copy.mark_written(param)

    def _after_step(self) -> None:
        self._pending_grads.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._pending_grads.clear()
        super().zero_grad(set_to_none=set_to_none)

    def discard_fp8_grads(self) -> None:
        """Drop this step's FP8 gradients (a skipped step): the kept buffers are zeroed, so no
        inf/NaN handed over in backward stays in the state or reaches a checkpoint."""
        for state in self.state.values():
            if "grad" in state:
                _local(state["grad"]).zero_()
                state["grad_scale"].fill_(1.0)
        self._pending_grads.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_grads.clear()
        super().load_state_dict(merge_split_groups(self.param_groups, state_dict))


def split_group_counts(groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> list[int] | None:
    """How many of the `saved` param groups each of `groups` (the optimizer's) was split into (1 or
    2) when they were saved in FP8-LM O2's layout before `unscaled_format` (each group split in two,
    FP8 GEMM weights first, then the others with FP32 formats); None for any other layout."""
    if len(saved) <= len(groups) or any(g.get("unscaled_format") is None for g in groups):
        return None
    counts, at = [], 0
    for group in groups:
        scaled = [get_master_scale(p) is not None for p in group["params"]]
        parts = [n for n in (sum(scaled), len(scaled) - sum(scaled)) if n]
        if [len(g["params"]) for g in saved[at : at + len(parts)]] != parts:
            return None
        counts.append(len(parts))
        at += len(parts)
    return counts if at == len(saved) else None


def merge_split_groups(groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with its groups as `groups` (the optimizer's) when it was saved with each group
    split in two (`split_group_counts`): each pair becomes one group whose parameters follow the
    current group's order. Any other state dict is returned as it is (torch's checks apply)."""
    saved = state_dict.get("param_groups", [])
    counts = split_group_counts(groups, saved)
    if counts is None:
        return state_dict  # not that layout: torch's error names the mismatch
    merged, at = [], 0
    for group, count in zip(groups, counts):
        scaled = [get_master_scale(p) is not None for p in group["params"]]
        pieces = saved[at : at + count]
        at += count
        fp8 = iter(pieces[0]["params"] if scaled.count(True) else [])
        rest = iter(pieces[-1]["params"] if scaled.count(False) else [])
        params = [next(fp8) if is_fp8 else next(rest) for is_fp8 in scaled]
        formats = {k: group[k] for k in ("exp_avg_format", "exp_avg_sq_format", "unscaled_format")}
        merged.append({**pieces[0], **formats, "params": params})
    return {**state_dict, "param_groups": merged}


def merge_split_schedule(counts: list[int], schedule: dict[str, Any]) -> dict[str, Any]:
    """An LR scheduler's `state_dict` saved over the split groups (`split_group_counts` gave `counts`)
    as one over the merged groups: every per-group list (`base_lrs`, `_last_lr`, `lr_lambdas`, ...)
    keeps the first entry of each split pair (the two halves of one group had the same values)."""
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    total = sum(counts)
    return {k: [v[i] for i in firsts] if isinstance(v, list) and len(v) == total else v for k, v in schedule.items()}
