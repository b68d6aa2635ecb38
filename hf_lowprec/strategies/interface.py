"""The precision-strategy interface: `PrecisionStrategy`, whose hooks do nothing by default.

This module is the interface only. Beside it: `StrategyOptimizer`, the wrapper that runs the
hooks around any optimizer (`strategies.optimizer`); the options and their type check
(`strategies.options`); where a strategy trains, one frozen `EngineSupport` per class
(`strategies.support`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from ..distributed import any_rank, local_shard
from ..grouped_experts import install_grouped_experts
from ..guard import Guard, guard_config, guard_metrics, guard_state, load_guard_state
from ..metrics import step_metrics
from ..numerics import nonfinite_flag
from ..optim.adamw import check_adamw_hyperparameters
from ..scaling import narrow_grad_norm, step_unless
from .adopt import adopt_loaded_dtypes
from .inputs import cast_float_inputs
from .optimizer import StrategyOptimizer, as_param_groups
from .options import StrategyOptions, build_options
from .prepared import UNCONVERTED_OPTIONS, check_added_dtypes, convert_added, mark_prepared, prepared_already
from .seen_norm import SeenNorm
from .support import EngineSupport, check_sharded_parameters, refuse_dtensors_outside_fsdp2

__all__ = ["EngineSupport", "PrecisionStrategy", "StrategyOptions", "StrategyOptimizer"]

logger = logging.getLogger(__name__)


class PrecisionStrategy:
    """Base class: every hook does nothing (FP32 semantics) until a subclass overrides it.

    A strategy is one small class that overrides only what it changes. The Trainer glue
    (`hf_lowprec.integrations.trainer`), the Accelerate plugin and custom loops all drive a
    strategy through the same hooks:

        model = strategy.prepare_model(model)
        optimizer = strategy.create_optimizer(param_groups, lr=..., betas=..., eps=..., weight_decay=...)
        with strategy.forward_context():
            loss = model(**batch).loss
        strategy.scale_loss(loss).backward()
        optimizer.step()          # runs strategy.process_gradients, then strategy.optimizer_step

    or, for the last four lines, `loss = strategy.train_step(model, batch, optimizer)`.

    The step never waits for the device: whether a step is skipped is a tensor (`found_inf`, see
    `process_gradients`), and loss scales and their decisions stay on the device too. The host
    reads the device only when a user reads a counter: `metrics()` (logging steps), `state_dict()`
    (checkpoints), `StrategyOptimizer.step_was_skipped` (as GradScaler-based loops do to skip their
    LR scheduler step; the Trainer and the Accelerate plugin read the flag a step late instead, once
    the step has run: `integrations.deferred_skip`), and `lost_arithmetic_metrics` on its measured
    steps only.

    Class attributes a subclass sets:
        Options: frozen dataclass of the strategy's options (subclass of StrategyOptions).
        param_dtype: dtype of trainable parameters after `prepare_model`.
        compute_dtype: dtype the forward pass computes in.
        bytes_per_param: documented model-state bytes per parameter (params + grads +
            optimizer states + extra components), checked by the contract test.
        skips_nonfinite: skip an optimizer step whose gradients hold inf/NaN.
        uses_fp8_gemm: linear layers compute in FP8 (the startup check requires an FP8 layer).
        support: the engines it trains under with its numerics, one frozen declaration
            (`strategies.support.EngineSupport`); `engine_support()` is what the engines read.
        takes_user_optimizer: the strategy's numerics are any optimizer under its forward
            context and loss scaling (what `bf16=True` / `fp16=True` do), so the Trainer accepts
            the user's optimizer and scheduler; the others define their own optimizer.
    """

    Options: ClassVar[type[StrategyOptions]] = StrategyOptions
    param_dtype: ClassVar[torch.dtype] = torch.float32
    compute_dtype: ClassVar[torch.dtype] = torch.float32
    bytes_per_param: ClassVar[float] = 16.0
    skips_nonfinite: ClassVar[bool] = True
    uses_fp8_gemm: ClassVar[bool] = False
    needs: ClassVar[str] = ""  # what the strategy requires beyond this package (shown by `hf-lowprec list`)
    support: ClassVar[EngineSupport] = EngineSupport()
    # Options a resume may change: they decide how the step runs or what is measured and
    # saved, not the layout or meaning of the saved state. Any other change is refused
    # (`hf_lowprec.checkpoints.resume.check_resume_options`).
    resume_safe_options: ClassVar[frozenset[str]] = UNCONVERTED_OPTIONS
    takes_user_optimizer: ClassVar[bool] = False
    recasts: ClassVar[bool] = False  # convert_model is a cast to param_dtype, run again for parameters added later
    # name → the options it fixes, written by `registry.register` (the unknown-option error leaves them out).
    registered_presets: ClassVar[dict[str, dict[str, Any]]] = {}
    prepared_state: ClassVar[tuple[str, ...]] = ()  # what convert_model sets up, taken over by an equal strategy

    def __init__(self, name: str | None = None, **options: Any) -> None:
        self.name = name or type(self).__name__
        preset = self.registered_presets.get(self.name, {})
        self.options = build_options(self.name, self.Options, options, preset)
        # Skipped steps: those counted before a resume (host), plus this run's on the device.
        self._skipped_before = 0
        self._skipped_on_device: torch.Tensor | None = None
        self._skipped_logged = 0
        self.measure_next_step = False
        self._grad_norm_seen: torch.Tensor | None = None  # this step's pre-clip norm (`note_grad_norm`)
        self._clip_seen: SeenNorm | None = None  # the same with the gradients it covers (`seen_norm`)
        self._data_parallel_group: Any = None
        self._lost_arithmetic: dict[str, float] = {}
        config = guard_config(self.options.guard)
        self.guard = Guard(config, self) if config is not None else None

    @property
    def frozen_in_fp8(self) -> bool:
        """Frozen models beside the trained one keep FP8 blocks (`integrations.frozen`): FP8 GEMMs."""
        return self.uses_fp8_gemm

    def engine_support(self) -> EngineSupport:
        """Where this strategy, with its options, trains (the engines, support matrix and refusals read it)."""
        return self.support

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, options={self.options})"

    # --- model -------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model to train: 16-bit parameters adopted where the strategy promises FP32 (`adopt`), then
        `convert_model`; high-precision experts take autocast's dtype (`install_grouped_experts`). Marked:
        prepared again under an equal strategy only what was added since is converted (`convert_added`),
        under another refused (`prepared`); DTensor parameters outside FSDP2 are refused first."""
        refuse_dtensors_outside_fsdp2(model)
        if prepared_already(self, model):
            return convert_added(self, model)
        adopt_loaded_dtypes(self, model)
        model = self.convert_model(model)
        install_grouped_experts(model)
        if self.guard is not None:
            self.guard.attach(model)
        mark_prepared(self, model)
        return model

    def convert_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The strategy's own conversion (dtypes, module swaps); what a subclass overrides."""
        return model

    def discard_prepared_state(self) -> None:
        """Forget the initial weights `prepare_model` kept for `create_optimizer` (a resume starts from the checkpoint's)."""

    # --- FSDP2 -------------------------------------------------------------------------
    def fsdp2_mixed_precision(self) -> Any:
        """The `MixedPrecisionPolicy` FSDP2 applies to this strategy's (converted) model.

        Default: gather parameters in their own dtype and reduce gradients in FP32 (a 16-bit
        gradient is averaged over ranks in FP32 and rounded once into the shard)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(reduce_dtype=torch.float32)

    def after_sharding(self, model: torch.nn.Module) -> None:
        """After FSDP2 swapped `model`'s parameters for DTensor shards: re-point what was keyed on the others."""

    # --- optimizer ---------------------------------------------------------------------
    def build_optimizer(
        self,
        param_groups: list[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ) -> torch.optim.Optimizer:
        """The inner optimizer for `param_groups` (override; the default is FP32-style AdamW)."""
        from ..optim import PlainAdamW

        return PlainAdamW(
            param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=self.options.fused
        )

    def create_optimizer(
        self,
        params_or_groups: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> StrategyOptimizer:
        """Build this strategy's optimizer from parameters or parameter groups.

        Group-level keys (a no-decay group's `weight_decay=0.0`) win over the arguments, as in torch.optim;
        weight_decay is TrainingArguments' 0.0 unless given. The result is a `torch.optim.Optimizer`."""
        groups = as_param_groups(params_or_groups)
        if not groups or not any(g["params"] for g in groups):
            raise ValueError("create_optimizer got no parameters; pass model.parameters() or param groups")
        check_adamw_hyperparameters(f"precision strategy {self.name!r}", lr, betas, eps, weight_decay)
        check_sharded_parameters(self, [p for g in groups for p in g["params"]])
        check_added_dtypes(self, groups)
        inner = self.build_optimizer(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        return StrategyOptimizer(inner, self)

    # --- forward / backward ------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass (e.g. autocast)."""
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call backward on (loss scaling)."""
        return loss

    def train_step(
        self,
        model: torch.nn.Module,
        batch: dict[str, Any] | torch.Tensor,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        max_grad_norm: float | None = None,
    ) -> torch.Tensor:
        """One training step of a custom loop, through this strategy's hooks; returns the loss, detached (unscaled).

        Forward under `forward_context`, backward on `scale_loss(loss)`, optional clipping of
        the unscaled gradients, `optimizer.step()` (the `create_optimizer` wrapper: gradient
        processing, skipped steps, metrics), then `zero_grad`.

        Args:
            batch: the model's keyword inputs (`model(**batch).loss`), or a tensor of token ids
                for a causal LM (`model(input_ids=batch, labels=batch).loss`). Its float tensors but
                the loss's (`inputs.LOSS_INPUTS`) take the weights' dtype where the strategy has no autocast.
            loss_fn: `loss_fn(model, batch)` instead of the above.
            max_grad_norm: clip to this global norm (`clip_grad_norm`).
        Raises:
            PrecisionPromiseError: before the first step, as the Trainer's `report.check_promises`.
        """
        if not model.__dict__.get("_hf_lowprec_promises_checked"):  # what the Trainer checks at startup
            from ..report import check_promises

            check_promises(self, model)  # all of them: model.half() after prepare_model, no FP8 layer, ...
            model.__dict__["_hf_lowprec_promises_checked"] = True
        batch = cast_float_inputs(self, batch)
        with self.forward_context():
            if loss_fn is not None:
                loss = loss_fn(model, batch)
            elif torch.is_tensor(batch):
                loss = model(input_ids=batch, labels=batch).loss
            else:
                loss = model(**batch).loss
        self.scale_loss(loss).backward()
        if max_grad_norm is not None:
            inner = getattr(optimizer, "optimizer", optimizer)
            self.unscale_gradients(inner)
            # What the optimizer trains: its groups, and fp8-lm-o3's FP8 weights, held outside them.
            params = [p for g in optimizer.param_groups for p in g["params"]] + list(getattr(inner, "fp8_params", []))
            self.clip_grad_norm(params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def set_gradient_accumulation(self, micro_batches: int, *, sums: bool = False) -> None:
        """Told by the loop that each micro-batch loss was divided by `micro_batches` (the
        Trainer and Accelerate do that); a strategy that averages micro-batches itself undoes it.
        `sums`: the loop expects what its backward passes sum to, as stock Accelerate gives it
        (a loop that accumulates by hand divides each loss itself), not their mean."""

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Undo loss scaling on gradients.

        Called before gradient clipping and again at the start of the step: a strategy that
        scales must make the second call a no-op within one step.
        """

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip unscaled gradients to the global norm `max_norm`; the pre-clip total norm (a
        tensor), as `torch.nn.utils.clip_grad_norm_` returns it (`max_norm=inf`: only measure).

        A custom loop's: the strategy's own clipping, else an FP32 norm of 16-bit gradients, else torch's."""
        params = list(parameters)
        norm = self.clip_own_grad_norm(params, max_norm)
        norm = narrow_grad_norm(params, max_norm) if norm is None else norm
        return self.note_grad_norm(torch.nn.utils.clip_grad_norm_(params, max_norm) if norm is None else norm, params)

    def note_grad_norm(self, norm: Any, parameters: Iterable[torch.Tensor] | None = None) -> Any:
        """Keep the pre-clip gradient norm the training loop's clipping measured this step (a
        device tensor), for the guard, which then measures nothing itself, and, given the clipped
        `parameters`, for the step's non-finite flag (`seen_norm`); returns `norm`."""
        # A DTensor norm (FSDP2) is left to the guard's own measure of this rank's shards.
        plain = torch.is_tensor(norm) and not isinstance(norm, DTensor)
        self._grad_norm_seen = norm.detach() if plain else None
        self._clip_seen = SeenNorm.of(norm, parameters) if plain and parameters is not None else None
        return norm

    def take_grad_norm(self) -> torch.Tensor | None:
        """The norm `note_grad_norm` kept since the last call, or None; forgotten once taken."""
        norm, self._grad_norm_seen = self._grad_norm_seen, None
        return norm

    def clip_own_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> Any:
        """Hook: clip where the loop's own function would be wrong (FP16 norms overflow, FP8
        gradients outside `p.grad`) and return the pre-clip norm (norm_type 2 or inf), or None to
        leave clipping to the training loop's function (torch's, Accelerate's or DeepSpeed's)."""

    def clip_own_grad_value(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Hook: clamp the gradients held outside `p.grad` (O2's FP8 ones) to ±clip_value."""

    # --- step --------------------------------------------------------------------------
    def process_gradients(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Work on gradients before the step; `found_inf`, whether to skip it, without a host sync.

        Returns a 0-dim FP32 tensor on the gradients' device: 1.0 where the step must be skipped
        (here: `skips_nonfinite` is set and a gradient holds inf or NaN, or the clipping's norm
        of them is not finite: `nonfinite_gradients`), 0.0 otherwise. Every rank returns the same
        value: the flag is MAX-ed over the FSDP2 mesh (each rank checked its shards) and over
        `set_data_parallel_group`'s group (under ZeRO each rank checked its partition) by an
        all-reduce of the tensor. An override keeps all three: a tensor, no `.item()` or `bool()`
        of device data, agreed over the ranks.
        """
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        device = local_shard(params[0]).device if params else None
        if not self.skips_nonfinite:
            return torch.zeros((), dtype=torch.float32, device=device)
        return any_rank(self.nonfinite_gradients(grads, device), grads, self._data_parallel_group)

    def nonfinite_gradients(self, grads: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
        """`numerics.nonfinite_flag(grads)` on `device` (given), read from this step's clipping norm where it covers them (`seen_norm`)."""
        seen, self._clip_seen = self._clip_seen, None
        flag = seen.nonfinite_flag(grads, device) if seen is not None else None  # None: not covered
        return (flag if flag is not None else nonfinite_flag([local_shard(g) for g in grads], device)).to(device)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> Any:
        """The step itself: the inner optimizer's `step(found_inf=found_inf)`, which leaves θ and
        every state untouched where `found_inf` is nonzero (see `step_unless`), as torch's fused AdamW
        does with GradScaler's flag."""
        return step_unless(optimizer, found_inf)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far, this run's read from the device (a sync: read it when logging)."""
        on_device = 0 if self._skipped_on_device is None else int(self._skipped_on_device.item())
        return self._skipped_before + on_device

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_before = int(value)
        self._skipped_on_device = None
        self._skipped_logged = min(self._skipped_logged, self._skipped_before)

    def count_skip(self, found_inf: torch.Tensor) -> None:
        """Add this step's `found_inf` (0 or 1) to the skipped-step counter, on the device (FP32: exact to 2^24)."""
        if self._skipped_on_device is None or self._skipped_on_device.device != found_inf.device:
            base = self._skipped_on_device
            self._skipped_on_device = torch.zeros((), dtype=torch.float32, device=found_inf.device)
            if base is not None:  # the gradients moved device: carry the count over (once)
                self._skipped_before += int(base.item())
        self._skipped_on_device.add_(found_inf)

    def ddp_comm_hook(self) -> tuple[Any, Callable] | None:
        """(state, hook) for `ddp_model.register_comm_hook`, or None to keep DDP's all-reduce."""
        return None

    def set_data_parallel_group(self, group: Any) -> None:
        """Told the data-parallel ranks (DDP's process group, DeepSpeed's data-parallel group)
        before the first step: the decision to skip a step is taken on every rank together
        (under ZeRO each rank checks only its partition of the gradients), and a strategy whose
        decisions read other rank-local values (activation statistics) agrees over them too."""
        self._data_parallel_group = group

    # --- what is active -----------------------------------------------------------------
    def promised_param_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes trainable parameters may have after `prepare_model` (checked at startup)."""
        return (self.param_dtype,)

    # --- state and metrics -------------------------------------------------------------
    def full_precision_state_dict(
        self, model: torch.nn.Module, optimizer: Any | None = None
    ) -> dict[str, torch.Tensor]:
        """FP32 weights keyed like `model.state_dict()`, each parameter as the optimizer holds it.

        A parameter the optimizer updates is its `full_precision_value`: θ + δθ summed in FP64
        and rounded once for an expansion (Collage, Kahan), the master for a master-weight
        scheme, a plain FP32 copy otherwise; other floating tensors are FP32 copies, the rest
        copies. Tied weights stay one tensor. The result loads into a plain FP32 model.

        Under FSDP2 (DTensor parameters) every rank must call it: each value is computed on
        the shards and gathered one tensor at a time; rank 0 gets the full dict in host memory,
        the other ranks an empty one (no device holds more than one full tensor beyond its shards).
        """
        from ..memory import unwrap_optimizer

        inner = unwrap_optimizer(optimizer) if optimizer is not None else None
        full_value = getattr(inner, "full_precision_value", None)
        updated = {id(p) for g in inner.param_groups for p in g["params"]} if full_value is not None else set()
        out: dict[str, torch.Tensor] = {}
        done: dict[int, torch.Tensor] = {}
        sharded = False
        with torch.no_grad():
            for key, tensor in model.state_dict(keep_vars=True).items():
                if id(tensor) not in done:
                    if id(tensor) in updated:
                        value = full_value(tensor)
                    elif tensor.is_floating_point():
                        value = tensor.detach().to(torch.float32, copy=True)
                    else:
                        value = tensor.detach().clone()
                    if hasattr(value, "full_tensor"):  # a DTensor: gather it (a collective)
                        sharded = True
                        value = value.full_tensor()
                        # Only rank 0 keeps full tensors, in host memory (a GPU holds its shards).
                        value = value.cpu() if torch.distributed.get_rank() == 0 else None
                    done[id(tensor)] = value
                out[key] = done[id(tensor)]
        if sharded and torch.distributed.get_rank() != 0:
            return {}
        return out

    def exported_state_dict(
        self, model: torch.nn.Module, optimizer: Any | None, state_dict: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor] | None:
        """The weights to write when the model is saved (`save_pretrained`, the Trainer's
        `save_model`): `state_dict` (None: the model's own) unless the strategy holds some
        weights elsewhere. fp8-lm-o3 gathers each FP8 weight's master from its owner here, a
        collective: every rank calls it."""
        return state_dict

    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to continue bit-for-bit (counters, scales), as plain
        Python values: reading it waits for the device (checkpoints only)."""
        return {"skipped_steps": self.skipped_steps, **guard_state(self.guard)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._skipped_logged = self._skipped_before
        load_guard_state(self.guard, state.get("guard"))

    def metrics(self) -> dict[str, float]:
        """Metrics for the logs, under stable `precision/...` keys.

        Reads the device counters (a sync): call it at logging steps. Steps skipped since the
        last call are logged here as one warning, since the step itself cannot know it on the host.
        """
        skipped = self.skipped_steps
        if skipped > self._skipped_logged:
            logger.warning(
                "%s: %d step(s) skipped since the last log (%d so far)",
                "non-finite gradients" if self.guard is None else "non-finite gradients or the guard's outliers",
                skipped - self._skipped_logged,
                skipped,
            )
            self._skipped_logged = skipped
        return {"precision/skipped_steps": float(skipped), **self._lost_arithmetic, **guard_metrics(self.guard)}

    def _measure_lost_arithmetic(self, records: list | None, group_count: int) -> None:  # None: skipped
        self._lost_arithmetic = step_metrics(records, group_count) if records is not None else {}
