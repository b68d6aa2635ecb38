"""Graphcore automatic loss scaling (ALS) for FP16, decided on the device.

`AutomaticLossScaler` (docs/algorithms.md §5; ALS post, seed 002): a two-bin histogram of the
gradients sets the scale, overflowing FP16 gradients are clipped rather than skipped, and every
decision stays on the device. Plain torch: no Trainer, Accelerate or DeepSpeed import.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from ..compiling import run_fused, run_fused_rows, takes_gpu_path
from ..distributed import DTensor
from ..numerics import round_to_dtype
from .loss_scale import check_loss_scaler_settings, step_unless
from .tallies import (
    A_TOTAL,
    A_UPPER,
    P_STEPS,
    P_TOTAL,
    P_UPPER,
    W_UPPER,
    ActivationTally,
    clamp_fp16_,
    decide_scale,
    gradient_counts,
    sum_over_ranks,
    tally_activation,
    unscale_half_together,
)

__all__ = ["AutomaticLossScaler"]

logger = logging.getLogger(__name__)


class AutomaticLossScaler:
    """Histogram-based loss scaling that clips instead of skipping (Graphcore ALS).

    Used like `torch.amp.GradScaler`:

        scaler = AutomaticLossScaler()
        scaler.track(model)                 # activation-gradient hooks and parameter names
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)          # clamp to ±65504, histogram, divide by the scale
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)              # never skipped for overflow
        scaler.update()

    Args:
        bin_edge: edge between the two bins of |g| (seed 2^13; PopART's default is 2^12).
        threshold: upper-bin share above which the scale halves.
        period: steps between scale updates; the histogram sums over the period.
        init_scale: starting scale (seed: 1).
        max_scale: upper bound (Graphcore's 2^15). Gradients are unscaled in FP16, so a larger
            scale only moves values further from the FP16 maximum.
        min_scale: lower bound (2^-16): below 1 the backward pass itself runs scaled down, which
            keeps activation gradients of models that overflow at scale 1 in range.
        track_activations: count (and clip) activation gradients too, via tensor hooks on the
            outputs of the leaf modules of the model passed to `track`.
        device: where the buffers start; all live on the gradients' device (they follow the loss to it in `scale`).

    The rule: after each backward, |g| of the weight gradients and (optionally) of the activation
    gradients is counted in two bins over FP16's range, split at `bin_edge`. Every `period`
    steps, with share = upper-bin count / total count:

        share > threshold  → scale ← max(scale / 2, min_scale)
        otherwise          → scale ← min(scale · 2, max_scale)

    Clip, don't skip: overflowing FP16 gradients are clamped to ±65504 (activation gradients as
    they flow through backward, weight gradients in `unscale_`), so no step is lost to an inf and
    the histogram sees the clipped values in its upper bin. Only a NaN skips a step (`step`).

    On the device: the scale, the histogram, the NaN flag, the clipped counts and the rule
    itself are tensors updated in place (`torch.where`, as `torch._amp_update_scale_` does for
    GradScaler): a step never waits for the device. The host reads the tallies when asked
    (`get_scale`, the `last_*` properties, `state_dict`, `log_overflows`): at logging steps.

    Under data parallelism (`process_group` set, as DDP's `engines.ddp.prepare_ddp` does through the strategy)
    every rank must take the same decision from the same histogram: the activation gradients (each rank's own half
    of the batch) and the NaN flag are summed over the group by one all-reduce per step; the weight gradients,
    already all-reduced, count once. Under FSDP2 (DTensor gradients) every tally is summed over the mesh.
    """

    def __init__(
        self,
        bin_edge: float = 2.0**13,
        threshold: float = 1e-7,
        period: int = 1,
        init_scale: float = 1.0,
        max_scale: float = 2.0**15,
        min_scale: float = 2.0**-16,
        track_activations: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        check_loss_scaler_settings(bin_edge, threshold, period, init_scale, max_scale, min_scale)
        self.bin_edge = float(bin_edge)
        # The edge as each gradient dtype holds it: an eager comparison rounds it to the tensor's
        # dtype, a compiled one would not; both forms compare against the rounded value.
        self._edges = {dt: round_to_dtype(self.bin_edge, dt) for dt in (torch.float16, torch.bfloat16, torch.float32)}
        self.threshold = float(threshold)
        self.period = period
        self.max_scale = float(max_scale)
        self.min_scale = float(min_scale)
        self.track_activations = bool(track_activations)
        self._handles: dict[int, list[Any]] = {}  # id(model) → its forward hooks
        self._names: dict[int, str] = {}  # id(parameter) → name, for the overflow log
        self._slots: dict[str, int] = {}  # name → its row in the per-name buffers
        self._unscaled: set[int] = set()
        self.process_group: Any = None  # DDP's group: activation tallies summed over it
        self._group: Any = None  # the FSDP2 process group, once sharded gradients were seen
        self._reduced = False
        self._probe: torch.Tensor | None = None  # compiled activation tallies: see `track`
        # Device state. Across steps (checkpointed): the scale, the period's tallies, the last
        # decision's share and the clipped counts.
        self._scale = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self._period = torch.zeros(3, dtype=torch.int64, device=device)
        self._last_share = torch.zeros((), dtype=torch.float64, device=device)
        self._last_clipped = torch.zeros((), dtype=torch.int64, device=device)
        self._total_clipped = torch.zeros((), dtype=torch.int64, device=device)
        # This step's tallies, zeroed by `update`.
        self._step = torch.zeros(4, dtype=torch.int64, device=device)
        self._nan = torch.zeros((), dtype=torch.float32, device=device)
        # Per name: elements clipped this step, whether it clipped last step, and how many new
        # overflow episodes began since the last `log_overflows`.
        self._clipped = torch.zeros(0, dtype=torch.int64, device=device)
        self._indices: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._overflowing = torch.zeros(0, dtype=torch.bool, device=device)
        self._new_episodes = torch.zeros(0, dtype=torch.int64, device=device)

    # --- GradScaler API ----------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale, read from the device (a sync, as `GradScaler.get_scale`)."""
        return float(self._scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss · scale, formed in FP32 (an FP16 loss times 2^15 could overflow)."""
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        self._to(loss.device)
        return loss * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Count, clamp to ±65504 and divide the weight gradients by the scale, once per step."""
        if id(optimizer) in self._unscaled:
            return
        self._unscaled.add(id(optimizer))
        half: list[torch.Tensor] = []
        half_rows: list[int] = []
        other: list[torch.Tensor] = []
        for index, param in enumerate(p for g in optimizer.param_groups for p in g["params"]):
            grad = param.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor):  # an FSDP2 shard: count it here, `_agree` sums over ranks
                self._group = grad.device_mesh.get_group()
                grad = grad.to_local()
            row = self._slot(self._names.get(id(param), f"param{index}"))
            if grad.dtype == torch.float16:
                half.append(grad)
                half_rows.append(row)
            else:
                self._record(row, grad, W_UPPER)
                other.append(grad)
        if half and self._step.device != half[0].device:
            self._to(half[0].device)
        inverse = self._scale.reciprocal()  # a power of two: exact
        if half and takes_gpu_path(half[0].device):
            # A GPU's form: the counts, clamps and unscaling of every FP16 gradient in one compiled
            # graph (a few kernels a step, not eight per gradient), the same bits as below.
            args = (self._step, self._clipped, self._nan, inverse, self._edge(torch.float16))
            rows = [(grad, self._index(row, grad.device)) for row, grad in zip(half_rows, half)]
            run_fused_rows(unscale_half_together, rows, *args, like=half[0])
        elif half:
            for row, grad in zip(half_rows, half):
                self._record(row, grad, W_UPPER)
            clamp_fp16_(half)
            # Multiplies in FP32 and rounds once to FP16 (a plain FP16 multiply would round the
            # inverse 2^16 itself to inf); after the clamp only a NaN is non-finite.
            torch._amp_foreach_non_finite_check_and_unscale_(half, self._nan, inverse)
            clamp_fp16_(half)  # below scale 1 a gradient that fitted scaled may not fit unscaled
        for grad in other:  # an FP32 gradient (a parameter the model keeps FP32): no clamp, so inf skips too
            self._nan.copy_(torch.maximum(self._nan, grad.isfinite().logical_not().any().to(self._nan.dtype)))
            grad.mul_(inverse)

    def found_nan(self, optimizer: torch.optim.Optimizer, also: torch.Tensor | None = None) -> torch.Tensor:
        """This step's NaN flag of the weight gradients (1.0: skip), agreed over the ranks; a
        0-dim FP32 tensor on the gradients' device, no host sync (unscales first if needed).
        `also`: the caller's own flag (1.0: skip) of gradients written since `unscale_`, taken
        into the step's flag before the ranks agree on it (as a NaN, it halves the scale)."""
        self.unscale_(optimizer)
        if also is not None:
            self._nan.copy_(torch.maximum(self._nan, also.to(self._nan.dtype)))
        self._agree()
        return self._nan.clone()  # the buffer itself is zeroed by `update`

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """`optimizer.step()` after `unscale_`; skipped only when a gradient is NaN, on the
        device when the optimizer takes `found_inf` (see `step_unless`).

        A NaN cannot be clipped: it is not an overflowing magnitude but a lost value (inf − inf,
        0·inf upstream, or a NaN loss). A step whose weight gradients hold a NaN is therefore
        skipped (a strategy counts it in its `skipped_steps`), and `update` halves the scale at once (whatever the
        period), as for a saturated step. This is the only skip."""
        return step_unless(optimizer, self.found_nan(optimizer), *args, **kwargs)

    def update(self) -> None:
        """Close the step on the device: apply the ALS rule at the end of a period (or at once
        on a NaN), fold the clipped counts into the totals, zero the step's tallies."""
        self._agree()
        self._reduced = False
        self._unscaled.clear()
        buffers = (self._scale, self._period, self._last_share, self._last_clipped, self._total_clipped)
        buffers += (self._step, self._clipped, self._nan, self._overflowing, self._new_episodes)
        rule = (self.period, self.threshold, self.min_scale, self.max_scale)
        if takes_gpu_path(self._scale.device):  # one compiled graph, not forty eager launches
            run_fused(decide_scale, *buffers, *rule, like=self._scale)
        else:
            decide_scale(*buffers, *rule)

    # --- what the host reads (each a sync) ---------------------------------------------
    @property
    def last_upper_share(self) -> float:
        """The upper-bin share of the last scale decision."""
        return float(self._last_share)

    @property
    def last_clipped(self) -> int:
        """Elements clipped to ±65504 in the last step."""
        return int(self._last_clipped)

    @property
    def total_clipped(self) -> int:
        """Elements clipped to ±65504 in all steps."""
        return int(self._total_clipped)

    def log_overflows(self) -> list[str]:
        """Log the names (parameters, modules' outputs) that began overflowing since the last
        call, with how often; the names. Called at logging steps (a step cannot log without a sync)."""
        episodes = self._new_episodes.tolist()
        names = [name for name, row in self._slots.items() if episodes[row]]
        if names:
            listed = ", ".join(
                f"{n}" if episodes[self._slots[n]] == 1 else f"{n} ({episodes[self._slots[n]]}×)" for n in names
            )
            logger.warning("FP16 overflow clipped to ±65504 at loss scale %g in: %s", self.get_scale(), listed)
            self._new_episodes.zero_()
        return names

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (safe for `torch.load(weights_only=True)`); reads the device."""
        period = self._period.tolist()
        overflowing = self._overflowing.tolist()
        return {
            "scale": self.get_scale(),
            "period_upper": period[P_UPPER],
            "period_total": period[P_TOTAL],
            "steps_in_period": period[P_STEPS],
            "overflowing": sorted(name for name, row in self._slots.items() if overflowing[row]),
            "last_upper_share": self.last_upper_share,
            "last_clipped": self.last_clipped,
            "total_clipped": self.total_clipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scale = float(state["scale"])
        if not (math.isfinite(scale) and self.min_scale <= scale <= self.max_scale):
            raise ValueError(
                f"saved loss scale {scale} lies outside [min_scale, max_scale] = [{self.min_scale}, {self.max_scale}]"
            )
        self._scale.fill_(scale)
        for index, key in ((P_UPPER, "period_upper"), (P_TOTAL, "period_total"), (P_STEPS, "steps_in_period")):
            self._period[index].fill_(int(state[key]))
        self._last_share.fill_(float(state["last_upper_share"]))
        self._last_clipped.fill_(int(state["last_clipped"]))
        self._total_clipped.fill_(int(state["total_clipped"]))
        rows = [self._slot(name) for name in state["overflowing"]]
        self._overflowing.zero_()
        for row in rows:
            self._overflowing[row] = True

    # --- tallies -----------------------------------------------------------------------
    def _record(self, row: int, grad: torch.Tensor, upper_index: int) -> None:
        """Add `grad` to this step's histogram (at `upper_index`, its total next to it) and its
        elements beyond ±65504 to row `row` of the clipped counts: in-place adds, traceable."""
        if self._step.device != grad.device:
            self._to(grad.device)
        upper, clipped = gradient_counts(grad, self._edge(grad.dtype))
        self._step[upper_index].add_(upper)
        self._step[upper_index + 1].add_(grad.numel())
        if clipped is not None:
            self._clipped[row].add_(clipped)

    def _agree(self) -> None:
        """Sum this step's tallies over the ranks, once per step (one all-reduce per group).

        Under FSDP2 each rank counted its weight-gradient shards and the activation gradients of
        its own samples: every tally is summed. Under DDP the weight gradients are already the
        same on every rank: the activation tallies and the NaN flag are summed. Then every rank
        takes the same scale decision and skips the same steps."""
        if self._reduced:
            return
        self._reduced = True
        self._fold_probe()
        if self._group is not None:
            sum_over_ranks(self._group, [self._step, self._nan, self._clipped])
        group = self.process_group
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            sum_over_ranks(group, [self._step[A_UPPER:], self._nan])

    def _fold_probe(self) -> None:
        """Add the counts the compiled backward left in `_probe.grad` (FP64 sums of integers
        below 2^53: exact) to this step's tallies, and clear them."""
        probe = self._probe
        if probe is None or probe.grad is None:
            return
        counts = probe.grad.to(self._step.device, torch.int64)
        probe.grad = None
        self._step[A_UPPER].add_(counts[:, 0].sum())
        self._step[A_TOTAL].add_(counts[:, 1].sum())
        self._clipped[: counts.shape[0]].add_(counts[:, 2])

    def _slot(self, name: str) -> int:
        """The row of `name` in the per-name buffers, adding one (outside any step's hot path)."""
        row = self._slots.get(name)
        if row is None:
            row = self._slots[name] = len(self._slots)
            self._clipped = torch.cat([self._clipped, self._clipped.new_zeros(1)])
            self._overflowing = torch.cat([self._overflowing, self._overflowing.new_zeros(1)])
            self._new_episodes = torch.cat([self._new_episodes, self._new_episodes.new_zeros(1)])
        return row

    def _index(self, row: int, device: torch.device) -> torch.Tensor:
        """Row `row` as a one-element index on `device`, made once (not copied to it every step)."""
        index = self._indices.get((row, device))
        if index is None:
            index = self._indices[(row, device)] = torch.tensor([row], device=device)
        return index

    def _edge(self, dtype: torch.dtype) -> float:
        return self._edges.get(dtype, self.bin_edge)

    def _to(self, device: torch.device) -> None:
        """Move the device state to `device` (once: where the loss and gradients live)."""
        if self._scale.device == device:
            return
        for key in ("_scale", "_period", "_last_share", "_last_clipped", "_total_clipped", "_step", "_nan"):
            setattr(self, key, getattr(self, key).to(device))
        for key in ("_clipped", "_overflowing", "_new_episodes"):
            setattr(self, key, getattr(self, key).to(device))
        if self._probe is not None:
            self._fold_probe()
            self._probe = self._probe.detach().to(device).requires_grad_()

    # --- activation gradients ----------------------------------------------------------
    def track(self, model: torch.nn.Module) -> AutomaticLossScaler:
        """Name `model`'s parameters in overflow logs and, with `track_activations`, hook the
        outputs of its leaf modules so that their gradients are counted and clipped.

        Eagerly, the forward hook registers a tensor hook on each leaf module's output that adds its counts into
        the step's buffers and clamps it. Inside `torch.compile` a side effect in backward cannot be traced, so
        the forward hook instead passes the output through `ActivationTally`, whose backward clamps the
        gradient and returns the counts as the gradient of a small FP64 leaf (`_probe`, one row per name):
        autograd accumulates them there like a parameter's gradient, and `_agree` folds them into the tallies.
        Same counts, one graph, no host sync.

        Every model tracked stays tracked (a policy beside a value or reference model; a frozen one has gradients
        to count only where they flow through it); tracking it again, or a wrapper of it (PEFT's), replaces its hooks."""
        self.untrack(model)
        names = {id(p): name for name, p in model.named_parameters()}
        self._names.update(names)
        for name in names.values():
            self._slot(name)
        first = next(model.parameters(), None)
        if first is not None:
            self._to(first.device)
        if self.track_activations:
            hooks = self._handles.setdefault(id(model), [])
            for name, module in model.named_modules():
                if next(module.children(), None) is None:
                    hooks.append(module.register_forward_hook(self._forward_hook(self._slot(name or "model"))))
            self._fold_probe()  # a probe with a row per name, the counts so far in the tallies
            rows = len(self._slots)
            self._probe = torch.zeros(rows, 3, dtype=torch.float64, device=self._scale.device, requires_grad=True)
        return self

    def untrack(self, model: torch.nn.Module | None = None) -> None:
        """Remove the hooks of `model` and of the models tracked inside it (every model's when None)."""
        for key in list(self._handles) if model is None else [id(module) for module in model.modules()]:
            for handle in self._handles.pop(key, ()):
                handle.remove()
        if not self._handles:
            self._fold_probe()
            self._probe = None

    def _forward_hook(self, row: int) -> Any:
        # A bound method in a partial, not a closure: a model holding the hook pickles (torch.save(model)).
        return functools.partial(self._tally_forward, row)

    def _tally_forward(self, row: int, module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._tally_compiled(row, output)
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for out in outputs:
            if torch.is_tensor(out) and out.requires_grad and out.is_floating_point():
                out.register_hook(functools.partial(self._activation_grad, row))
        return None

    def _tally_compiled(self, row: int, output: Any) -> Any:
        """`output` with each floating tensor that needs a gradient passed through
        `ActivationTally` (counts into `_probe`'s row `row`); None when nothing needs one."""

        def tally(out: Any) -> Any:
            if torch.is_tensor(out) and out.requires_grad and out.is_floating_point():
                return ActivationTally.apply(out, self._probe, row, self._edge(out.dtype))
            return out

        if isinstance(output, (tuple, list)):
            outputs = [tally(out) for out in output]
            return output._make(outputs) if hasattr(output, "_make") else type(output)(outputs)
        return tally(output) if torch.is_tensor(output) else None

    # Run eagerly in backward, not traced into a compiled graph: the tallies are written in place
    # into buffers that a traced backward would save for autograd and then find modified.
    @torch._dynamo.disable
    def _activation_grad(self, row: int, grad: torch.Tensor) -> torch.Tensor | None:
        if self._step.device != grad.device:
            self._to(grad.device)
        args = (self._step, self._clipped, row, self._edge(grad.dtype))
        if not takes_gpu_path(grad.device):
            return tally_activation(grad, *args)
        # A GPU's form: one compiled graph per hook (its counts and clamp fused), not seven launches;
        # flat, so one graph serves every shape of activation (dynamic in its length only).
        clamped = run_fused(tally_activation, grad.reshape(-1), *args, like=grad)
        return None if clamped is None else clamped.view(grad.shape)

    def __repr__(self) -> str:
        return (
            f"AutomaticLossScaler(bin_edge={self.bin_edge}, threshold={self.threshold}, "
            f"period={self.period}, bounds=[{self.min_scale}, {self.max_scale}])"
        )
