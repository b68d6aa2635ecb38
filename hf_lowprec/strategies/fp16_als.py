"""FP16 training with Graphcore automatic loss scaling (docs/algorithms.md §5; ALS post, seed 002).

`FP16ALS` combines pieces of `hf_lowprec.scaling` (`AutomaticLossScaler`: two-bin histogram, clip
instead of skip; running-mean gradient accumulation) and `hf_lowprec.optim` (`MasterWeightAdamW`,
or `FP32StatesSRAdamW` with `weights="sr"`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

import torch

from ..distributed import local_shard, written_version
from ..memory import unwrap_optimizer
from ..numerics import nonfinite_flag
from ..optim import FP32StatesSRAdamW, MasterWeightAdamW
from ..scaling import AutomaticLossScaler, RunningMeanGradients, check_loss_scaler_settings
from .casting import cast_model, narrow_kept_parameters
from .fp16_base import LossScaledStrategy
from .interface import PrecisionStrategy, StrategyOptions
from .registry import register
from .seen_norm import SeenGradients
from .support import EngineSupport

__all__ = ["FP16ALS", "FP16ALSOptions"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FP16ALSOptions(StrategyOptions):
    """Options of fp16-als (the scaler's settings are `AutomaticLossScaler`'s).

    Args:
        weights: "master" (FP32 master copy) or "sr" (FP16 weights written with stochastic
            rounding, no master).
        running_mean: average micro-batch gradients with the running mean (the loop must not
            divide the loss by the number of micro-batches; the Trainer glue undoes its own). Where
            the loop names its N micro-batches (`set_gradient_accumulation`), each scaled backward is
            the next and every gradient is its sum over N, an unreached micro-batch adding 0; else a
            micro-batch is a forward of the model (backward passes after one forward add up) and the
            mean is over those that reached the parameter. Under the Accelerate plugin the step takes
            the sum, as stock Accelerate's loop gets it.
        seed: seed of the stochastic-rounding generator (weights="sr" only; checkpointed). None:
            drawn from the run's seed (`optim.lowprec_optimizer.seed_from_run`: the Trainer's
            `--seed`, every rank's).
        seed_compensation: weights="master": when `PrecisionStrategy.prepare_model` converts FP32,
            FP64 or BF16 parameters, keep their FP32 values and start each master at its own (the
            FP16 weight alone keeps 11 of FP32's 24 bits and flushes values below 2⁻²⁵ to zero).
    """

    weights: Literal["master", "sr"] = "master"
    bin_edge: float = 2.0**13
    threshold: float = 1e-7
    period: int = 1
    init_scale: float = 1.0
    max_scale: float = 2.0**15
    min_scale: float = 2.0**-16
    track_activations: bool = True
    running_mean: bool = True
    seed: int | None = None
    seed_compensation: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_loss_scaler_settings(
            self.bin_edge, self.threshold, self.period, self.init_scale, self.max_scale, self.min_scale
        )

    def unread_options(self) -> dict[str, str]:
        unread = super().unread_options()
        if self.weights == "master":
            unread["seed"] = (
                "seed seeds the stochastic rounding of weights='sr', and weights='master' rounds to nearest: "
                "drop seed (or pass weights='sr')"
            )
        else:
            unread["seed_compensation"] = (
                "seed_compensation starts the FP32 masters of weights='master' at the FP32 weights, and "
                "weights='sr' keeps no master: drop seed_compensation (or pass weights='master')"
            )
        return unread


@register("fp16-als")
class FP16ALS(LossScaledStrategy):
    """Graphcore ALS: FP16 weights, activations and gradients, clipped not skipped; FP32 AdamW states and master.

    The weight update keeps an FP32 master copy (16 bytes/param) or, with `weights="sr"`, writes
    the FP16 weights with stochastic rounding and keeps no master (12 bytes/param).
    """

    Options = FP16ALSOptions
    # A new seed restarts the stochastic-rounding generators from it (StrategyOptimizer.load_state_dict);
    # seed_compensation acts only on a fresh run, between prepare_model and create_optimizer.
    resume_safe_options = PrecisionStrategy.resume_safe_options | {"seed", "seed_compensation"}
    param_dtype = torch.float16
    recasts = True
    support = EngineSupport(
        ddp_note="DDP's all-reduce of the FP16 gradients; the loss-scale histogram summed over the ranks (one decision)",
        zero_refusal=(
            "DeepSpeed's FP16 engine owns the loss scale: its optimizer checks the partitions for overflow, "
            "skips the step and moves the scale by its own dynamic rule, while ALS sets the scale from a "
            "histogram of activation and weight gradients taken during backward and clips overflows instead of "
            "skipping; riding on DeepSpeed would mean replacing the scaler inside DeepSpeed's optimizer, which "
            "is not built, and DeepSpeed's CPU accelerator has no FP16; for ZeRO pick a BF16 strategy "
            "(bf16-mixed, collage-plus), or train fp16-als with DDP"
        ),
        fsdp2=True,
        fsdp2_note=(
            "FP16 shards, FP32 masters and AdamW states; FP16 all-gather, FP32 reduce-scatter; the "
            "scaler's histogram and NaN counts summed by one all-reduce"
        ),
    )

    prepared_state = ("_residuals", "scaler", "accumulator")  # the scaler's hooks are on the model

    def __init__(self, name: str | None = None, **options: Any) -> None:
        super().__init__(name, **options)
        o = self.options
        self.scaler = AutomaticLossScaler(
            bin_edge=o.bin_edge,
            threshold=o.threshold,
            period=o.period,
            init_scale=o.init_scale,
            max_scale=o.max_scale,
            min_scale=o.min_scale,
            track_activations=o.track_activations,
        )
        self.accumulator = RunningMeanGradients() if o.running_mean else None
        self._loss_divisor = 1
        self._sums = False  # the loop expects the sum of its micro-batch gradients (the Accelerate plugin)
        self._sharded = False
        self._window_start = 0  # `_scaled_backwards` when this accumulation window began
        self._unscaled_seen: SeenGradients | None = None  # the gradients as this step's unscale left them
        # id(parameter) → (parameter, its FP32 value before the cast, its version counter after it), from
        # prepare_model until build_optimizer seeds the masters with them (the engines' name, as Collage's;
        # the value itself tells which elements were written since: `_master_residual`).
        self._residuals: dict[int, tuple[torch.Tensor, torch.Tensor, tuple[int, int]]] = {}

    @property
    def bytes_per_param(self) -> float:  # type: ignore[override]
        return 16.0 if self.options.weights == "master" else 12.0

    def engine_support(self) -> EngineSupport:
        """FSDP2 with weights="master" only."""
        if self.options.weights == "master":
            return self.support
        return dataclasses.replace(
            self.support,
            fsdp2=False,
            fsdp2_refusal=(
                "with weights='sr' every rank would draw the stochastic rounding of its shard from the same "
                "seeded stream (not one process's draws); use weights='master' under FSDP2"
            ),
        )

    def convert_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Cast to FP16, keeping each wide trainable parameter's FP32 value for its master."""
        wide = {}
        if self.options.weights == "master" and self.options.seed_compensation:
            for param in model.parameters():
                if param.requires_grad and param.is_floating_point() and param.dtype != self.param_dtype:
                    # An FP32 parameter's own storage (`Module.to` gives the parameter a new one): no copy.
                    wide[id(param)] = (param, param.detach().float())
        model = cast_model(model, torch.float16, keep_fp32_parameters=True)  # stepped as FP32 AdamW
        # `Module.to` converts parameters in place (same objects), so the keys still hold.
        kept = {key: (p, v, written_version(p)) for key, (p, v) in wide.items() if p.dtype == self.param_dtype}
        self._residuals.update(kept)
        self.scaler.track(model)
        if self.accumulator is not None:
            self.accumulator.attach(model)
        return model

    def before_sharding(self, model: torch.nn.Module) -> None:
        narrow_kept_parameters(model, self.param_dtype)

    def after_sharding(self, model: torch.nn.Module) -> None:
        # FSDP2 hands each shard one reduce-scattered gradient per backward: the running mean's
        # hooks on the (replaced) parameters never run, so accumulation over micro-batches is
        # FSDP2's own sum (see `set_gradient_accumulation`). The scaler names the new parameters.
        self.scaler.track(model)
        if self.accumulator is not None:
            self.accumulator.detach()
            self._sharded = True

    def discard_prepared_state(self) -> None:
        self._residuals.clear()

    def rebind_prepared(self, earlier: FP16ALS, model: torch.nn.Module) -> tuple[str, ...]:
        """Take over a model `earlier` prepared (a second Trainer): this strategy's own scaler and running
        mean hook it instead of `earlier`'s, so that the new run starts from the initial loss scale, as
        the same run in a fresh process does. Returns the `prepared_state` handled here."""
        earlier.scaler.untrack(model)
        self.scaler.track(model)
        if earlier.accumulator is not None:
            earlier.accumulator.detach()
        if self.accumulator is not None:
            self.accumulator.attach(model)
        return ("scaler", "accumulator")

    def build_optimizer(self, param_groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.Optimizer:
        if self.options.weights == "sr":
            return FP32StatesSRAdamW(param_groups, seed=self.options.seed, fused=self.options.fused, **hyper)
        optimizer = MasterWeightAdamW(param_groups, fused=self.options.fused, **hyper)
        for group in optimizer.param_groups:
            for param in group["params"]:
                claimed = self._residuals.pop(id(param), None)
                # `resize_token_embeddings` swaps in a tensor of another shape: its master starts at the weight.
                if claimed is not None and claimed[0] is param and claimed[1].shape == param.shape:
                    # The FP32 value goes with `claimed`, as the next parameter's is popped.
                    optimizer.seed_compensation(param, _master_residual(param, claimed[1]))
        if self._residuals:
            # An optimizer over other tensors (e.g. DeepSpeed's partitions) cannot take them.
            logger.info("%d FP32 values not claimed by the optimizer were dropped", len(self._residuals))
            self._residuals.clear()
        return optimizer

    def set_gradient_accumulation(self, micro_batches: int, *, sums: bool = False) -> None:
        # The loop divided each micro-batch loss by `micro_batches`; the running mean averages
        # by itself, so undo that division (exact in FP32: it multiplies a scalar gradient).
        if self._sharded and micro_batches > 1:
            raise ValueError(
                "fp16-als accumulates micro-batch gradients with its running mean, which FSDP2's "
                "reduce-scatter replaces; under FSDP2 accumulate with get_strategy('fp16-als', "
                "running_mean=False) (the loop's divided sum) or train without accumulation"
            )
        self._loss_divisor = micro_batches if self.accumulator is not None else 1
        self._sums = sums

    def set_data_parallel_group(self, group: Any) -> None:
        # Each rank sees the activation gradients of its own half batch: the scale decision
        # sums the histogram over the ranks, or the ranks' scales (and weights) would drift apart.
        super().set_data_parallel_group(group)
        self.scaler.process_group = group

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        scaled = super().scale_loss(loss)
        if self.accumulator is not None:
            # Where the loop names its N micro-batches, each scaled backward is the next of them: a
            # parameter it does not reach counts a zero gradient there, as in stock's sum over N.
            declared = self._loss_divisor > 1
            index = self._scaled_backwards - self._window_start
            self.accumulator.micro_batch(index if declared else None)
            if declared and index == self._loss_divisor:
                # Every mean over N before the last backward: DDP's all-reduce, which runs in it, then
                # sees each rank's sum over N, a parameter that backward does not reach included.
                self.accumulator.to_sums(self.accumulator.params(), self._loss_divisor)
        return scaled if self._loss_divisor == 1 else scaled * self._loss_divisor

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # Before clipping and the step: a parameter unfrozen (or added) since `prepare_model` has
        # summed this window's micro-batches without the running mean's hook; it takes their mean.
        # Where the loop expects the sum (Accelerate's), the means become the sums over the divisor undone;
        # where it named N micro-batches, a parameter the last did not reach takes its mean over N.
        if self.accumulator is not None and not self._sharded:
            params = [p for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]]
            if self._sums or self._loss_divisor > 1:
                self.accumulator.to_sums(params, self._loss_divisor)
            micro_batches = self._loss_divisor if self._sums else self._scaled_backwards - self._window_start
            self.accumulator.adopt(params, micro_batches)
        super().unscale_gradients(optimizer)
        if self._unscaled_seen is None and not self.idle(optimizer):  # the step's one unscale
            self._unscaled_seen = SeenGradients.of(_grads(optimizer))

    def clip_own_grad_norm(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        params = list(parameters)
        seen = self._unscaled_seen
        unchanged = seen.unchanged(p.grad for p in params if p.grad is not None) if seen is not None else []
        norm = super().clip_own_grad_norm(params, max_norm, norm_type)
        if seen is not None:
            # A factor of at most 1 keeps a finite gradient finite (a NaN the unscale saw made it NaN, and the
            # flag 1); one written before the clipping stays changed, and the step checks it.
            seen.renew(unchanged)
        return norm

    def process_gradients(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Overflow is already clipped; only a NaN (which no clip can repair) skips the step.
        The scaler's NaN flag, agreed over the ranks with its histogram (one all-reduce), set as it
        unscaled: it decides for the gradients unchanged since (clipping's factor aside). A gradient
        written after (a callback's edit, noise) is checked again, and an inf or NaN there skips the
        step too, as every strategy's check does (`seen_norm`): one multi-tensor check, only then."""
        if self.idle(optimizer):
            return self.idle_flag(optimizer)
        seen, self._unscaled_seen = self._unscaled_seen, None
        changed = seen.changed(_grads(optimizer)) if seen is not None else []  # None: found_nan unscales all
        also = nonfinite_flag([local_shard(g) for g in changed]) if changed else None
        return self.scaler.found_nan(unwrap_optimizer(optimizer), also)

    def end_step(self) -> None:
        super().end_step()
        self._unscaled_seen = None
        self._window_start = self._scaled_backwards
        if self.accumulator is not None:
            self.accumulator.reset()

    def metrics(self) -> dict[str, float]:
        self.scaler.log_overflows()  # the names that began overflowing since the last log
        return {
            **super().metrics(),
            "precision/upper_bin_share": self.scaler.last_upper_share,
            "precision/clipped_elements": float(self.scaler.last_clipped),
            "precision/clipped_elements_total": float(self.scaler.total_clipped),
        }


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in unwrap_optimizer(optimizer).param_groups for p in g["params"] if p.grad is not None]


def _master_residual(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value − θ in FP32, exact (θ = r₁₆(value) differs from it below FP16's last bit, 13 bits at
    most), so the master θ + residual is the FP32 value; value itself where θ is ±0 (a zero's sign
    kept) and −0.0, adding nothing, where θ no longer rounds from it (a weight loaded after
    `PrecisionStrategy.prepare_model`). Element-wise: per shard under FSDP2 (DTensors)."""
    from torch.distributed.tensor import DTensor

    theta, wide = (param.to_local(), value.to_local()) if isinstance(param, DTensor) else (param, value)
    theta = theta.detach()
    residual = torch.where(theta == 0, wide, wide - theta.float())
    residual = torch.where(wide.to(theta.dtype) == theta, residual, -0.0)
    if not isinstance(param, DTensor):
        return residual
    return DTensor.from_local(residual, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
