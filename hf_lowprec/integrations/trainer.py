"""`precision_strategy=` for `transformers.TrainingArguments` and `transformers.Trainer`.

The glue is two mixins so that any Trainer subclass (TRL's SFTTrainer, …) gets the same
behaviour in one line:

    @dataclass
    class MyConfig(PrecisionArgumentsMixin, trl.SFTConfig): ...
    class MyTrainer(PrecisionTrainerMixin, trl.SFTTrainer): ...
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
import warnings
from typing import Any

import torch
import transformers
from transformers import TrainerCallback

from ..checkpoints.complete_save import save_complete_checkpoint
from ..checkpoints.converted import keeping_dtypes, load_best_model, load_in_model_format
from ..checkpoints.fp8_published import release_for_training, write_published_fp8
from ..checkpoints.fsdp2_trainer import load_trainer_optimizer, save_rank_optimizer, trainer_rank_world
from ..checkpoints.manifest import crash_point
from ..checkpoints.resume import RESETTABLE, checked_resume
from ..engines.ddp import prepare_ddp
from ..memory import unwrap_optimizer
from ..report import (
    SilentPrecisionWarning,
    check_promises,
    describe,
    format_report,
    silent_precision_problem,
    warn_slow_fp16_once,
)
from ..strategies.interface import PrecisionStrategy
from ..strategies.prepared import refuse_without_strategy
from ..strategies.registry import get_strategy
from ..version import one_resume
from .clipping import strategy_grad_norm
from .deferred_skip import note_trainer_skip, resolve_before_reads, resolve_skip
from .launch_env import launched_default
from .loss_scaling import scale_at_backward
from .model_saving import (
    all_fp32,
    gather_for_save,
    label_full_precision,
    refuse_unwritten_export,
    sharded_fsdp_export,
    weights_to_save,
)
from .optimizer_arguments import (
    accept_optimizer,
    adopt_optimizer,
    checked_create_optimizer,
    find_strategy_optimizer,
    reconcile_launched_mixed_precision,
    refuse_unwrapped,
    users_optimizer_named,
)
from .outputs import prepared_model
from .precision_arguments import check_precision_arguments, setup_trial, trial_precision
from .split_schedule import load_split_layout
from .stock_signature import bind_stock_arguments, forwarding_init

__all__ = ["PrecisionArgumentsMixin", "PrecisionTrainerMixin", "PrecisionCallback", "TrainingArguments", "Trainer"]

logger = logging.getLogger(__name__)

REPORT_FILE = "precision_report.json"  # the startup report's JSON, written to the output directory


@dataclasses.dataclass
class PrecisionArgumentsMixin:
    """Adds `precision_strategy` and `precision_options` to a TrainingArguments dataclass."""

    precision_strategy: str | None = dataclasses.field(
        default_factory=functools.partial(launched_default, "precision_strategy"),
        metadata={
            "help": "hf_lowprec precision strategy, e.g. 'bf16-pure', 'collage-plus', 'fp8-lm-o2'. "
            "The strategy owns mixed precision: leave --bf16/--fp16 unset."
        },
    )
    precision_options: dict | str | None = dataclasses.field(
        default_factory=functools.partial(launched_default, "precision_options"),
        metadata={
            "help": "Options of the precision strategy, a dict or a JSON string, "
            "e.g. '{\"lost_arithmetic_metrics\": true}'."
        },
    )
    resume_reset: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Parts of the training state a resume may start afresh when the checkpoint's file for "
            "them is missing or damaged, comma-separated: "
            + "; ".join(f"{part}: {what}" for part, what in RESETTABLE.items())
            + ". Default: none, and such a checkpoint is refused."
        },
    )

    def __post_init__(self) -> None:
        strategy = check_precision_arguments(self)  # the name, options and flags, before any work
        super().__post_init__()
        if strategy is not None:  # what `accelerate launch --mixed_precision` set, read by the stock __post_init__
            reconcile_launched_mixed_precision(self, strategy)

    def build_precision_strategy(self) -> PrecisionStrategy | None:
        """A fresh strategy object for these arguments (None when no strategy is set)."""
        if self.precision_strategy is None:
            return None
        return get_strategy(self.precision_strategy, **(self.precision_options or {}))


@dataclasses.dataclass
class TrainingArguments(PrecisionArgumentsMixin, transformers.TrainingArguments):
    """`transformers.TrainingArguments` plus `precision_strategy` and `precision_options`."""


class PrecisionCallback(TrainerCallback):
    """Prepares DDP/FSDP2/DeepSpeed for the strategy, writes the startup report, times steps and keeps
    the LR schedule aligned with skipped steps. Appended after the Trainer's callbacks: none of its events
    needs to run before theirs (the strategy's metrics join the logs in `PrecisionTrainerMixin.log` first)."""

    def __init__(self, strategy: PrecisionStrategy, trainer: Any = None) -> None:
        self.strategy = strategy
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is not None:  # before the first step: an optimizer no check saw (optimizer_arguments)
            refuse_unwrapped(self.strategy, self.trainer.optimizer)
        # DDP wraps the model in train() just before this event: the last moment for a communication hook.
        wrapped = getattr(self.trainer, "model_wrapped", None)
        ddp = isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        prepare_ddp(self.strategy, wrapped)
        if getattr(self.trainer, "is_fsdp_enabled", False) and not getattr(self.trainer, "_hf_lowprec_adopted", False):
            self.trainer._hf_lowprec_adopted = True
            self.trainer.adopt_fsdp2_shards()
        if getattr(self.trainer, "is_deepspeed_enabled", False):
            from ..engines.zero import attach_zero_optimizer

            # DeepSpeed swapped the optimizer's parameters for its partitions: seeded state moves with them.
            attach_zero_optimizer(getattr(wrapped, "optimizer", None))
        # Once per strategy: each model `model_init` builds (each trial of a search) has its own.
        if self.trainer is not None and getattr(self.trainer, "_hf_lowprec_reported", None) is not self.strategy:
            self.trainer._hf_lowprec_reported = self.strategy
            self._report(args, state, ddp)

    def _report(self, args, state, ddp: bool) -> None:
        """Log what is active, write it to the output directory, stop on a broken promise."""
        trainer = self.trainer
        plugin = getattr(getattr(trainer, "accelerator", None), "state", None)
        plugin = getattr(plugin, "deepspeed_plugin", None)
        stage = getattr(plugin, "zero_stage", None) if plugin is not None else None
        report = describe(self.strategy, trainer.model, trainer.optimizer, deepspeed_stage=stage, ddp=ddp)
        if frozen := getattr(trainer, "hf_lowprec_frozen_models", None):  # TRL's reference, reward, teacher
            report["frozen_models"] = frozen
        if state.is_world_process_zero:
            logger.info("%s", format_report(report))
            warn_slow_fp16_once(self.strategy, trainer.model)
            if args.output_dir:
                os.makedirs(args.output_dir, exist_ok=True)
                with open(os.path.join(args.output_dir, REPORT_FILE), "w") as f:
                    json.dump(report, f, indent=1, default=str)
        check_promises(self.strategy, trainer.model)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()
        if self.strategy.options.lost_arithmetic_metrics and args.logging_steps:
            steps = args.logging_steps
            if steps < 1:  # a ratio of the total, as the Trainer reads it
                steps = max(1, int(state.max_steps * steps))
            self.strategy.measure_next_step = (state.global_step + 1) % int(steps) == 0

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        start = getattr(self, "_step_start", None)
        if start is not None and self.trainer is not None:
            self.trainer.step_seconds.append(time.perf_counter() - start)
        resolve_before_reads(control, optimizer)

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        resolve_before_reads(control, optimizer)  # the epoch's evaluation comes after its last step's end

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        resolve_skip(find_strategy_optimizer(optimizer))

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # The Trainer steps its LR scheduler only where Accelerate reports no skip: the strategy's, read a step late.
        note_trainer_skip(optimizer, self.trainer)


class PrecisionTrainerMixin:
    """Applies `args.precision_strategy` to any `transformers.Trainer` subclass: the model is prepared
    after the base `__init__` (TRL's trainers load theirs from a name), the optimizer comes from the
    strategy, the forward runs in its context, its metrics join the logs, its state rides in the
    optimizer's checkpoint. Each override takes the stock signature; with no strategy it calls the
    stock method: the Trainer is the stock one (docs/launch.md)."""

    precision: PrecisionStrategy | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if PrecisionTrainerMixin in cls.__bases__ and "__init__" not in vars(cls):
            cls.__init__ = forwarding_init(cls)  # the stock class's signature, not (*args, **kwargs)
        if "create_optimizer" in vars(cls):  # your override's optimizer: wrapped in the strategy's step, or refused
            cls.create_optimizer = checked_create_optimizer(vars(cls)["create_optimizer"], cls.__qualname__)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        call = bind_stock_arguments(self, PrecisionTrainerMixin, args, kwargs).arguments
        refuse_without_strategy(call.get("args"), call.get("model"), type(self).__name__)  # before any work
        release_for_training(call)  # a published FP8 checkpoint's inference layers, trainable before the stock checks
        super().__init__(*args, **kwargs)
        build = getattr(self.args, "build_precision_strategy", None)
        self.precision = build() if build is not None else None
        if self.precision is None:
            return
        # Your optimizer under the strategy's step (loss scale, skipped steps), or a refusal.
        self.optimizer = self.callback_handler.optimizer = accept_optimizer(
            self.precision, self.optimizer, getattr(self, "optimizer_cls_and_kwargs", None)
        )
        prepared = prepared_model(self.precision, self.model)  # a PEFT model's frozen base: compute dtype
        if prepared is not self.model:
            self.model_wrapped = prepared if self.model_wrapped is self.model else self.model_wrapped
            self.model = prepared
        self.step_seconds: list[float] = []  # wall time of each training step, for reports and benchmarks
        if getattr(self, "is_fsdp_enabled", False):  # --fsdp, or `accelerate launch` with an FSDP config
            from ..engines.fsdp2 import configure_accelerator, refuse_full_precision_save

            # The strategy's policy for Accelerate's fully_shard calls; refuses FSDP1 and unsupported strategies.
            refuse_full_precision_save(self.precision, self.args.save_on_each_node)
            configure_accelerator(self.precision, self.accelerator, self.model)
        from ..engines.fsdp2 import warn_if_fsdp_fell_back

        warn_if_fsdp_fell_back(self.accelerator)  # an FSDP config on a CPU-only machine
        if getattr(self, "is_deepspeed_enabled", False):
            from ..engines.zero import configure_accelerator

            configure_accelerator(self.precision, self.accelerator, self.args.deepspeed or None)
            refuse_unwritten_export(
                self.precision, self.accelerator.state.deepspeed_plugin.deepspeed_config, self.model
            )
        self.callback_handler.add_callback(PrecisionCallback(self.precision, self))
        scale_at_backward(self)

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        # Only the arguments given, by keyword: TRL 1.12's PPOTrainer.train() takes none.
        given = {"trial": trial, "ignore_keys_for_eval": ignore_keys_for_eval}
        kwargs = {name: value for name, value in given.items() if value is not None}
        with one_resume():  # every check first (checkpoints/resume.py); the saving version once, from the manifest
            resume_from_checkpoint, self._resume_resets = checked_resume(
                self.args.output_dir, resume_from_checkpoint, self.precision, getattr(self.args, "resume_reset", None)
            )
            if "optimizer" in self._resume_resets:  # residuals of this run's initial weights would seed δθ
                self.precision.discard_prepared_state()
            if resume_from_checkpoint is not None:
                kwargs["resume_from_checkpoint"] = resume_from_checkpoint
            return super().train(**kwargs)

    def call_model_init(self, trial: Any = None) -> Any:
        # A search's trial: its precision arguments checked and set before its model is built and prepared
        # (the stock train() sets a trial's arguments after model_init, in _hp_search_setup).
        strategy = trial_precision(self, trial)
        model = super().call_model_init(trial)  # `model_init`: train() builds the model anew
        if getattr(self, "precision", None) is None:  # (in __init__: prepared after the stock __init__)
            refuse_without_strategy(self.args, model, type(self).__name__)
            return model
        self.precision = strategy if strategy is not None else self.args.build_precision_strategy()  # a fresh one
        for callback in (c for c in self.callback_handler.callbacks if isinstance(c, PrecisionCallback)):
            callback.strategy = self.precision
        return prepared_model(self.precision, model)

    def _hp_search_setup(self, trial: Any) -> None:
        setup_trial(self, trial, super()._hp_search_setup)  # less the precision call_model_init set

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.precision is not None and "loss" in logs:  # training logs carry the strategy's metrics
            logs.update(self.precision.metrics())
        return super().log(logs, start_time)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.precision is None:
            return super()._save_checkpoint(model, trial)
        resolve_skip(find_strategy_optimizer(self.optimizer))  # a skipped last step: its schedule held
        if self.precision.guard is not None:  # on every rank (rank 0 alone saves the optimizer's state)
            self.precision.guard.saving()  # a save is the guard's snapshot point
        # Complete on every rank (manifest written) before older checkpoints are rotated away.
        return save_complete_checkpoint(self, functools.partial(super()._save_checkpoint, model), trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.precision is not None and self.is_fsdp_enabled:  # what FSDP's own file drops
            save_rank_optimizer(find_strategy_optimizer(self.optimizer), output_dir, *trainer_rank_world(self))

    def _save_rng_state(self, output_dir: str) -> None:
        crash_point("save-rng-state")  # test-only: a rank dies before its RNG file exists
        super()._save_rng_state(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        ours = self.precision is not None and checkpoint is not None and not self.is_deepspeed_enabled
        self._load_state_of_optimizer_and_scheduler(checkpoint, ours)
        if ours:  # weights and state loaded: a later write (on_train_begin, a load) is where training goes on
            getattr(unwrap_optimizer(self.optimizer), "watch_parameter_values", lambda: None)()

    def _load_state_of_optimizer_and_scheduler(self, checkpoint: str | None, ours: bool) -> None:
        resets = getattr(self, "_resume_resets", set()) & {"optimizer", "scheduler"}
        if self.precision is not None and self.is_fsdp_enabled and load_trainer_optimizer(self, checkpoint, resets):
            return None
        # Ranks on CPU load to "cpu" (transformers 5.17 maps to "cpu:0", which torch cannot restore).
        cpu_ranks = self.args.world_size > 1 and self.args.device.type == "cpu" and not self.is_fsdp_enabled
        files = [os.path.join(checkpoint or "", f) for f in ("optimizer.pt", "scheduler.pt")]
        if ours and load_split_layout(self, checkpoint, resets):  # FP8-LM's older split groups, schedule included
            return None
        if checkpoint is None or not (resets or (cpu_ranks and all(map(os.path.isfile, files)))):
            return super()._load_optimizer_and_scheduler(checkpoint)
        if getattr(self, "is_deepspeed_enabled", False):
            # DeepSpeed loaded its optimizer with the model; only the scheduler file is left.
            return None if "scheduler" in resets else super()._load_optimizer_and_scheduler(checkpoint)
        if "optimizer" not in resets:
            state = torch.load(os.path.join(checkpoint, "optimizer.pt"), map_location="cpu", weights_only=True)
            self.optimizer.load_state_dict(state)
        if "scheduler" not in resets:
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self.precision is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # MoE experts saved per expert, merged back (the stock resume drops them: transformers#48805).
        if not load_in_model_format(self, resume_from_checkpoint, model):
            with keeping_dtypes(model if model is not None else self.model):  # PEFT's load upcasts adapters
                super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        super()._load_best_model() if self.precision is None else load_best_model(self, super()._load_best_model)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if "rng" not in getattr(self, "_resume_resets", set()):
            super()._load_rng_state(checkpoint)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        named = users_optimizer_named(self.precision, self.args, getattr(self, "optimizer_cls_and_kwargs", None))
        if self.precision is None or self.optimizer is not None or named:
            optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
            if self.precision is None:
                self._warn_silent_precision(self.model if model is None else model, optimizer)
                return optimizer
            # A later train() (or auto_find_batch_size's retry) finds Accelerate's wrapper of the
            # strategy's optimizer: that optimizer again, for Accelerate to wrap once. Another one (the
            # one your arguments name, or assigned to `trainer.optimizer`): wrapped, or refused.
            inner = find_strategy_optimizer(optimizer)
            source = "an assignment to trainer.optimizer after construction"
            self.optimizer = optimizer = adopt_optimizer(self.precision, optimizer, source)
            if optimizer is not inner:
                self._params_before_sharding = [p for g in optimizer.param_groups for p in g["params"]]
            return optimizer
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        self.optimizer = self.precision.create_optimizer(
            groups,
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
            weight_decay=self.args.weight_decay,
        )
        # Under FSDP2 the Trainer builds the optimizer before Accelerate shards the model.
        self._params_before_sharding = [p for g in self.optimizer.param_groups for p in g["params"]]
        return self.optimizer

    def adopt_fsdp2_shards(self) -> None:
        """After Accelerate's FSDP2 `prepare` swapped the optimizer's parameters for shards: the
        state started at construction (a seeded δθ) moves onto them, and the strategy adopts the
        sharded model (`hf_lowprec.engines.fsdp2.adopt_shards`), as `engines.fsdp2.shard_model` does."""
        from ..engines.fsdp2 import adopt_shards, move_state_to_shards

        move_state_to_shards(find_strategy_optimizer(self.optimizer), self._params_before_sharding)
        adopt_shards(self.precision, self.model, {})

    def _warn_silent_precision(self, model: torch.nn.Module, optimizer: Any) -> None:
        # Once per trainer: BF16/FP16 weights under a plain AdamW silently drop small updates.
        if getattr(self, "_hf_lowprec_warned", False):
            return
        problem = silent_precision_problem(model, optimizer)
        if problem is not None:
            self._hf_lowprec_warned = True
            warnings.warn(problem, SilentPrecisionWarning, stacklevel=3)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # The strategy's export (or full precision) under DeepSpeed or FSDP: a collective, on every rank.
        # FSDP's sharded state dict: the stock save writes no model file (then pushes), so the FP32
        # export is written first, but not into a checkpoint (`_save_checkpoint` names its folder).
        sharded, checkpoint = sharded_fsdp_export(self), _internal_call and output_dir is not None
        self._exported = None if sharded and checkpoint else gather_for_save(self)
        try:
            if sharded and not checkpoint:
                self._save(output_dir)
            super().save_model(output_dir, _internal_call)
        finally:
            self._exported = None
        # The model a user saves goes back in the FP8 format it was loaded from (a checkpoint to
        # resume from keeps every bit; `save_full_precision` asks for full precision).
        if self.precision is not None and not (_internal_call or self.precision.options.save_full_precision):
            if self.args.should_save:
                write_published_fp8(output_dir if output_dir is not None else self.args.output_dir, self.model)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        state_dict = weights_to_save(self, state_dict, getattr(self, "_exported", None))
        fp32 = all_fp32(self, state_dict)  # FP32 weights (or trained FP32 beside frozen BF16): say float32
        super()._save(output_dir, state_dict=state_dict)
        if fp32:
            label_full_precision(self, output_dir)

    def compute_loss_context_manager(self):
        stack = super().compute_loss_context_manager()
        if self.precision is not None:
            stack.enter_context(self.precision.forward_context())
            scale_at_backward(self)  # (again: hyperparameter search builds a new Accelerator)
        return stack

    def _clip_grad_norm(self, model):
        norm = None if self.precision is None else strategy_grad_norm(self, model, self.args.max_grad_norm)
        norm = norm if norm is not None else super()._clip_grad_norm(model)
        # The guard judges this pre-clip norm rather than measuring the clipped gradients again.
        return norm if self.precision is None else self.precision.note_grad_norm(norm, model.parameters())

    def _get_grad_norm(self, model, grad_norm=None):
        # Stock measures with clip_grad_norm_(max_norm=inf): NaN for FP16 gradients of norm > 65504.
        if grad_norm is not None or self.precision is None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        grad_norm = super()._get_grad_norm(model, grad_norm=strategy_grad_norm(self, model, float("inf")))
        return self.precision.note_grad_norm(grad_norm, model.parameters())  # as a clipping's norm


class Trainer(PrecisionTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` that applies `args.precision_strategy` (see `TrainingArguments`)."""
