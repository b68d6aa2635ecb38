"""TRL trainers with `precision_strategy`: one import change for a TRL script.

    from hf_lowprec.trl import SFTConfig, SFTTrainer      # was: from trl import SFTConfig, SFTTrainer
    args = SFTConfig(output_dir="out", precision_strategy="collage-plus")

Each config and trainer is TRL's with the Trainer glue (`with_precision`), plus the RL trainers'
rollouts and frozen models and PPO's own loop. `hf_lowprec.trl` is this module's short import
path; trl is imported on first use of a name here (without it the error names the extra).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import logging
from typing import Any

__all__ = [
    "SFTConfig",
    "SFTTrainer",
    "RewardConfig",
    "RewardTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "DPOConfig",
    "DPOTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "KTOConfig",
    "KTOTrainer",
    "DistillationConfig",
    "DistillationTrainer",
    "PPOConfig",
    "PPOTrainer",
    "TRAINER_KINDS",
    "with_precision",
]

# SFT, Reward, GRPO, DPO, RLOO, KTO and Distillation (every trainer of TRL's CLI) follow the current TRL line; PPOTrainer left TRL in 1.13, so PPO
# runs on the 1.12 line, installed by its own extra.
logger = logging.getLogger(__name__)

_TRL_EXTRA = "install the `trl` extra (from a checkout: pip install -e '.[trl]')"
_PPO_EXTRA = "install the `ppo` extra (from a checkout: pip install -e '.[ppo]')"


def __getattr__(name: str) -> Any:
    if name in ("PPOConfig", "PPOTrainer"):
        return _ppo_classes()[name]
    if name in __all__:
        return with_precision(getattr(_import("trl"), name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The TRL names this module wraps (PPO apart, see `_ppo_classes`).
TRAINER_KINDS = ("SFT", "Reward", "GRPO", "DPO", "RLOO", "KTO", "Distillation")


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"hf_lowprec.trl needs TRL: {_TRL_EXTRA} ({err})") from err


def _finish(cls: type, name: str) -> type:
    # Built inside a function, but pickled (training_args.bin) and documented under this module.
    cls.__name__ = cls.__qualname__ = name
    cls.__module__ = __name__
    return cls


@functools.cache
def _config_mixin() -> type:
    from .trainer import PrecisionArgumentsMixin

    class TRLPrecisionArguments(PrecisionArgumentsMixin):
        def __post_init__(self) -> None:
            # TRL turns bf16 on when it is unset; a strategy owns mixed precision instead (an
            # explicit --bf16 is still checked against it).
            if self.precision_strategy is not None and self.bf16 is None:
                self.bf16 = False
            super().__post_init__()
            if getattr(self, "cast_lm_head_to_fp32", False):
                _refuse_fp32_head(self.build_precision_strategy())

    return TRLPrecisionArguments


def _refuse_fp32_head(strategy: Any) -> None:
    """Refuse `cast_lm_head_to_fp32` where `prepare_model` casts the trained policy's head to 16 bits."""
    if strategy is not None and all(dtype.itemsize < 4 for dtype in strategy.promised_param_dtypes()):
        raise ValueError(
            f"cast_lm_head_to_fp32=True asks for an FP32 LM head, but precision_strategy={strategy.name!r} trains "
            f"every weight in {str(strategy.param_dtype).removeprefix('torch.')}, the trained policy's head too; "
            "drop cast_lm_head_to_fp32, or pick a strategy with FP32 master weights (bf16-mixed, fp8-lm-o1, "
            "fp8-lm-o2, coat)"
        )


@functools.cache
def with_precision(cls: type) -> type:
    """TRL's config or trainer class `cls` (one of `TRAINER_KINDS`) with `precision_strategy`.

    `cls` itself when it has it already (`hf-lowprec launch` puts these classes under TRL's names).
    """
    from .trainer import PrecisionArgumentsMixin, PrecisionTrainerMixin

    name = cls.__name__
    if issubclass(cls, (PrecisionArgumentsMixin, PrecisionTrainerMixin)):
        return cls
    if dataclasses.is_dataclass(cls):
        return _finish(dataclasses.dataclass(type(name, (_config_mixin(), cls), {"__doc__": _config_doc(cls)})), name)
    rollouts = (_RolloutInContext, _FrozenModels)
    extra = {"GRPOTrainer": rollouts, "RLOOTrainer": rollouts}.get(name, (_FrozenModels,))
    doc = f"`trl.{name}` applying `args.precision_strategy`."
    body: dict[str, Any] = {"__doc__": doc}
    for mixin in extra:  # a mixin's (*args, **kwargs) override shows the stock method's signature
        for attr, function in vars(mixin).items():
            if attr != "__init__" and inspect.isfunction(function) and callable(getattr(cls, attr, None)):
                body[attr] = _with_signature(function, getattr(cls, attr), f"{name}.{attr}")
    return _finish(type(name, (*extra, PrecisionTrainerMixin, cls), body), name)


def _with_signature(function: Any, stock: Any, qualname: str) -> Any:
    """`function` behind a forwarder that declares `stock`'s signature (code that introspects TRL's
    methods, the stock-compatibility test)."""

    @functools.wraps(function)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return function(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(stock)  # type: ignore[attr-defined]
    forward.__qualname__ = qualname
    return forward


def _config_doc(config: type) -> str:
    return f"`trl.{config.__name__}` plus `precision_strategy` and `precision_options`."


# The trainer arguments and attributes that hold frozen models, with their role.
_FROZEN_ROLES = {"ref_model": "reference", "reward_funcs": "reward", "teacher_model": "teacher"}


class _FrozenModels:
    """Keeps the frozen models beside the policy at their forward's precision (`integrations.frozen`).

    Models passed in are frozen before TRL's `__init__` (they never reach the device at the
    policy's precision); those TRL builds from names are frozen after it, in place. Each gets
    its own strategy object: a strategy may keep facts about the model it prepared (the policy's).
    The frozen models: DPO/KTO/GRPO/RLOO references, GRPO/RLOO reward models, the distillation
    teacher. `DPOTrainer`/`KTOTrainer`: pass `ref_model=` for a model built from a config (TRL
    would rebuild the reference from the empty `config._name_or_path`). The trained model passed as
    a frozen one is left as it is (TRL refuses it as a reference); a model frozen already to another
    storage is refused before any model changes, with no strategy too (unless it still holds FP32). Their outputs are FP32 as the policy's are
    (`outputs.widen_outputs`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from .frozen import check_refreeze, freeze_all, frozen_candidates
        from .stock_signature import bind_stock_arguments

        call = bind_stock_arguments(self, _FrozenModels, args, kwargs)  # positional or by keyword
        build = getattr(call.arguments.get("args"), "build_precision_strategy", None)
        strategy = build() if build is not None else None
        # sync_ref_model=True mixes the policy's weights into the reference: under a strategy it stays as passed.
        sync = strategy is not None and getattr(call.arguments["args"], "sync_ref_model", False)
        if sync:  # the sync mixes the weights the strategy's optimizer holds (reference_sync.py)
            from .reference_sync import check_sync

            check_sync(strategy, call.arguments.get("ref_model"))
        roles = [(a, r) for a, r in _FROZEN_ROLES.items() if a in call.arguments and not (r == "reference" and sync)]
        # The trained model passed as a frozen one too is left to TRL (DPO and KTO refuse it), and a model
        # another strategy froze (in place) is refused before any model is changed, with no strategy too.
        trained = call.arguments.get("model")
        for argument, role in roles:
            for candidate in frozen_candidates(call.arguments[argument], trained):
                check_refreeze(strategy, candidate, role)
        if strategy is not None:
            for argument, role in roles:
                call.arguments[argument] = freeze_all(strategy, call.arguments[argument], role, build, trained=trained)
            self._hf_lowprec_deferred_precompute: dict[int, tuple] = {}  # see _precompute_ref_logps
            from .trl_precompute import early_hash

            self._hf_lowprec_early_hash = early_hash(type(self), call.arguments)  # TRL 1.13's cache key
        super().__init__(*call.args[1:], **call.kwargs)
        deferred = self.__dict__.pop("_hf_lowprec_deferred_precompute", None)
        if self.precision is None:
            return
        if getattr(self.args, "sync_ref_model", False):
            from .reference_sync import sync_in_full_precision

            sync_in_full_precision(self)
        for attribute, role in _FROZEN_ROLES.items():
            if getattr(self, attribute, None) is None:
                continue
            if role == "reference" and getattr(self.args, "sync_ref_model", False):
                logger.info("sync_ref_model=True updates the reference from the policy: it is kept as TRL built it")
                continue
            head_fp32 = bool(getattr(self.args, "cast_lm_head_to_fp32", False))  # TRL cast it: keep it
            value = freeze_all(self.precision, getattr(self, attribute), role, build, head_fp32, trained=self.model)
            setattr(self, attribute, value)
        from .frozen import FROZEN_ATTR
        from .outputs import widen_outputs

        self.hf_lowprec_frozen_models = {}
        for attribute, role in _FROZEN_ROLES.items():
            value = getattr(self, attribute, None)
            for index, model in enumerate(value if isinstance(value, list) else [value]):
                widen_outputs(self.precision, model)  # FP32 outputs, as Accelerate's mixed precision gives them
                inner = model.module if type(model).__name__ == "DeepSpeedEngine" else model  # TRL wrapped it
                facts = getattr(inner, "__dict__", {}).get(FROZEN_ATTR)
                if facts is not None:
                    key = role if not isinstance(value, list) or len(value) == 1 else f"{role}[{index}]"
                    self.hf_lowprec_frozen_models[key] = facts
        if deferred:
            self._precompute_deferred(deferred)

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """DPO's and KTO's `precompute_ref_log_probs`: TRL runs it in its `__init__`, before the
        strategy prepared the model; it is put off until then, and runs in the training forward's
        context (so a LoRA reference, the policy without its adapter, computes as the policy does)."""
        deferred = self.__dict__.get("_hf_lowprec_deferred_precompute")
        if deferred is not None:
            deferred[id(dataset)] = (name, batch_size)
            return dataset
        if getattr(self, "precision", None) is None:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        from .trl_precompute import precompute  # under the strategy, with an inference engine's config

        return precompute(self, super()._precompute_ref_logps, dataset, name, batch_size)

    def _precompute_deferred(self, deferred: dict[int, tuple]) -> None:
        from .trl_precompute import run_deferred

        run_deferred(self, deferred)


class _RolloutInContext:
    """GRPO/RLOO: runs `_prepare_inputs` (where they generate and score) in the strategy's forward
    context (generation, reference and reward scoring: the old/reference log-probabilities are
    computed with the same numerics as the training forward), and measures how far the rollout's
    log-probs are from the training forward's (`integrations.rollout`): `precision/rollout_*` in
    the training logs."""

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        precision = getattr(self, "precision", None)
        if precision is None:
            return super()._prepare_inputs(generation_batch)
        with precision.forward_context():
            return super()._prepare_inputs(generation_batch)

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        measured = self.precision is not None and self.model.training  # evaluation rollouts are not measured
        if not measured or self.use_vllm or getattr(self, "use_transformers_continuous_batching", False):
            return super()._generate_single_turn(*args, **kwargs)
        from .rollout import RolloutLogprobs

        model = self.accelerator.unwrap_model(self.model_wrapped)
        inner = getattr(model, "_orig_mod", model)  # torch_compile: generation runs the original module
        get_base = getattr(inner, "get_base_model", None)  # a PEFT model generates through its base
        sequences: list[Any] = []
        full_forward = self.precision.options.rollout == "full_forward"
        original = model.generate

        def generate(*a: Any, **k: Any) -> Any:
            if full_forward:
                k["use_cache"] = False
            out = original(*a, **k)
            sequences.append(out)
            return out

        model.generate = generate  # this call's generate: an instance attribute over the class's
        try:
            with RolloutLogprobs(get_base() if callable(get_base) else inner, self.temperature) as recorder:
                result = super()._generate_single_turn(*args, **kwargs)
        finally:
            del model.generate
        # One generation per rollout is measured; tool loops generate again per turn (not measured).
        self._hf_rollout_turns = getattr(self, "_hf_rollout_turns", 0) + 1
        self._hf_rollout_logps = recorder.finish(sequences[0]) if len(sequences) == 1 else None
        return result

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        self._hf_rollout_logps, self._hf_rollout_turns = None, 0
        output = super()._generate_and_score_completions(inputs)
        logps, self._hf_rollout_logps = self._hf_rollout_logps, None
        if self.precision is None or not self.model.training:
            return output
        if output.get("sampling_per_token_logps") is not None:  # the sampler's own (vLLM)
            output["hf_lowprec_rollout_logps"] = output["sampling_per_token_logps"]
        elif logps is not None and self._hf_rollout_turns == 1:
            from .rollout import fit_width

            output["hf_lowprec_rollout_logps"] = fit_width(logps, output["completion_ids"].shape[1])
        self._hf_rollout_step = self.state.global_step  # a training rollout: the policy of this step
        return output

    def _compute_loss(self, model: Any, inputs: Any) -> Any:
        rollout = inputs.get("hf_lowprec_rollout_logps")
        same_policy = getattr(self, "_hf_rollout_step", None) == self.state.global_step
        if rollout is not None and self.model.training and same_policy:
            self._hf_compare = (rollout, inputs["completion_mask"])  # no update since the rollout
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._hf_compare = None

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        compare, self._hf_compare = getattr(self, "_hf_compare", None), None
        if compare is not None:
            self._mismatch_meter().add(result[0], *compare)
        return result

    def _mismatch_meter(self) -> Any:
        from .rollout import MismatchMeter

        if getattr(self, "_hf_mismatch", None) is None:
            self._hf_mismatch = MismatchMeter(self.accelerator.device)
        return self._hf_mismatch

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.precision is not None and "loss" in logs:
            # Every rank gathers at every training log, whether or not it measured anything since.
            logs = {**logs, **self._mismatch_meter().read(self.accelerator.gather)}
        return super().log(logs, start_time)


@functools.cache
def _ppo_classes() -> dict[str, type]:
    trl = _import("trl")
    try:
        ppo = importlib.import_module("trl.experimental.ppo")
    except ImportError:
        raise ImportError(
            f"PPOTrainer is not in TRL {trl.__version__}: TRL removed it in 1.13. PPO runs on the TRL 1.12 line: "
            f"{_PPO_EXTRA} (in its own environment if other TRL trainers should stay current)"
        ) from None
    import torch
    from transformers.integrations import is_deepspeed_zero3_enabled as zero3

    from ..strategies.interface import StrategyOptimizer
    from .frozen import freeze_all
    from .loss_scaling import scales_loss
    from .peft import is_peft_model, prepare_model
    from .trainer import PrecisionTrainerMixin

    config_cls = _finish(
        dataclasses.dataclass(
            type("PPOConfig", (_config_mixin(), ppo.PPOConfig), {"__doc__": _config_doc(ppo.PPOConfig)})
        ),
        "PPOConfig",
    )
    signature = inspect.signature(ppo.PPOTrainer.__init__)

    class PPOTrainer(PrecisionTrainerMixin, ppo.PPOTrainer):
        """`trl.experimental.ppo.PPOTrainer` applying `args.precision_strategy`.

        PPOTrainer (TRL 1.12; install the `ppo` extra) does not use the Trainer loop: it builds
        its optimizer and `accelerator.prepare` inside `__init__` and runs its own loop in
        `train()`. The strategy therefore prepares the policy and value models and freezes the
        reference and reward models before that `__init__`, builds the optimizer over the
        policy+value parameters, runs the whole of `train()` (rollouts and PPO epochs) in its
        forward context, and scales the PPO loss at `accelerator.backward` when it scales losses.
        Backward passes run inside that context too; autocast only affects forward ops, whose
        backward follows the dtypes chosen in the forward. The strategy's metrics join each PPO
        log line."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            call = signature.bind(self, *args, **kwargs).arguments
            call.pop("self")
            build = getattr(call["args"], "build_precision_strategy", None)
            self.precision = build() if build is not None else None
            if self.precision is not None:
                optimizer = (call.get("optimizers") or (None, None))[0]
                if optimizer is not None and not isinstance(optimizer, StrategyOptimizer):
                    raise ValueError(
                        f"precision_strategy={self.precision.name!r} builds the optimizer, but optimizers=(...) "
                        "passed another one; drop `optimizers=`"
                    )
                if call.get("peft_config") is not None:
                    # Wrap here, so the adapters exist when the strategy converts the model.
                    from peft import get_peft_model

                    call["model"] = get_peft_model(call["model"], call.pop("peft_config"))
                if call.get("ref_model") is None and not is_peft_model(call["model"]) and not zero3():
                    # TRL would copy the policy once prepared (create_reference_model): copy it before, to freeze
                    # (under ZeRO-3 TRL refuses to copy: left to it).
                    call["ref_model"] = copy.deepcopy(call["model"]).eval()
                for role in ("model", "value_model"):  # trained
                    if call.get(role) is not None:
                        call[role] = prepare_model(self.precision, call[role])
                for role, name in (("ref_model", "reference"), ("reward_model", "reward")):  # frozen
                    if call.get(role) is not None:
                        call[role] = freeze_all(self.precision, call[role], name, build)
            # PPOTrainer.__init__ builds the optimizer (our create_optimizer) and prepares it.
            super(PrecisionTrainerMixin, self).__init__(**call)
            from .frozen import FROZEN_ATTR

            frozen = (("reference", call.get("ref_model")), ("reward", call.get("reward_model")))
            self.hf_lowprec_frozen_models = {
                role: model.__dict__[FROZEN_ATTR]
                for role, model in frozen
                if FROZEN_ATTR in getattr(model, "__dict__", {})
            }
            # It skips Trainer.__init__, which sets this flag that Trainer._save reads on
            # non-saving ranks (transformers 5.x): without it, save_model fails under DDP.
            if not hasattr(self, "is_distributed_loading_by_transformers"):
                self.is_distributed_loading_by_transformers = False
            if scales_loss(self.precision):
                # train() calls `self.accelerator.backward(loss)` on the PPO loss itself: scale it there.
                backward = self.accelerator.backward

                def scaled_backward(loss: torch.Tensor, **kwargs: Any) -> None:
                    backward(self.precision.scale_loss(loss), **kwargs)

                scaled_backward.hf_lowprec_scaling = True  # type: ignore[attr-defined]  # (loss_scaling)
                self.accelerator.backward = scaled_backward

        def train(self) -> None:
            if self.precision is None:
                return super().train()
            with self.precision.forward_context():
                return super().train()

        def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
            # TRL 1.12 saves `self.model.policy`, which a DDP wrapper hides (it would save the
            # wrapped policy+value pair and fail on shared tensors): unwrap DDP first.
            wrapped = self.model
            if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
                self.model = wrapped.module
            try:
                super().save_model(output_dir, _internal_call)
            finally:
                self.model = wrapped

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if self.precision is not None:
                logs = {**logs, **self.precision.metrics()}
            return super().log(logs, start_time)

    PPOTrainer.__init__.__signature__ = signature  # it binds its arguments to the stock signature
    return {"PPOConfig": config_cls, "PPOTrainer": _finish(PPOTrainer, "PPOTrainer")}
