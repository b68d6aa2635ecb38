"""`precision_strategy` and `precision_options` checked: by the arguments' `__post_init__`
(`integrations.trainer`), and for each hyperparameter-search trial, whose values the stock `train()`
sets only after `model_init` built the model. `trial_precision` checks and sets a trial's before, so
its strategy prepares the model; `setup_trial` hands the stock `_hp_search_setup` the rest of the
trial (`hp_space` called once per trial).
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import torch
from transformers.trainer_utils import HPSearchBackend

from ..checkpoints.resume import parse_resume_reset
from ..strategies.interface import PrecisionStrategy
from .launch_env import InheritedOptions
from .optimizer_arguments import check_engine_arguments, reconcile_mixed_precision_flags

__all__ = [
    "PRECISION_FIELDS",
    "check_precision_arguments",
    "drop_options_of_another_strategy",
    "setup_trial",
    "trial_params",
    "trial_precision",
]

PRECISION_FIELDS = ("precision_strategy", "precision_options")

logger = logging.getLogger(__name__)


def check_precision_arguments(args: Any) -> PrecisionStrategy | None:
    """The strategy of `args` (None without one), its name and options validated and `precision_options`
    parsed from JSON; `bf16`/`fp16`, the full-eval flags, `optim` and the engine arguments reconciled
    with it or refused (`reconcile_mixed_precision_flags`, `check_engine_arguments`)."""
    parse_resume_reset(args.resume_reset)  # a bad part name fails before any work
    drop_options_of_another_strategy(args)
    if isinstance(args.precision_options, str):
        try:
            args.precision_options = json.loads(args.precision_options) if args.precision_options else {}
        except json.JSONDecodeError as err:
            raise ValueError(
                f"precision_options must be a JSON object, got {args.precision_options!r} ({err})"
            ) from None
    if args.precision_options is not None and not isinstance(args.precision_options, dict):
        raise ValueError(f"precision_options must be a dict or JSON object, got {args.precision_options!r}")
    strategy = args.build_precision_strategy()  # validates the name and options before any work
    if strategy is not None:
        reconcile_mixed_precision_flags(args, strategy)
        check_engine_arguments(args, strategy)
        refuse_export_of_a_model_only_best(args, strategy)
    elif args.precision_options:
        raise ValueError("precision_options were given without precision_strategy; set --precision_strategy")
    else:
        parse_resume_reset(args.resume_reset, with_strategy=False)  # without a strategy: nothing to reset
    return strategy


def drop_options_of_another_strategy(args: Any) -> None:
    """Inherited options (`launch_env.InheritedOptions`: the launcher's, a recipe's environment) apply to
    the strategy they came with; a run whose strategy is another (its own command line's) drops them, as
    `hf-lowprec launch` drops $HF_LOWPREC_PRECISION_OPTIONS when a --precision_strategy is typed."""
    options = args.precision_options
    if not isinstance(options, InheritedOptions):
        return
    args.precision_options = dict(options)  # a plain dict from here on: pickled, copied, compared
    if args.precision_strategy != options.strategy:
        logger.warning(
            "precision_options %s from %s ignored: they were given for precision_strategy=%r, and this run's "
            "precision_strategy is %r (set its own --precision_options)",
            json.dumps(args.precision_options),
            options.origin,
            options.strategy,
            args.precision_strategy,
        )
        args.precision_options = None


def _exports_optimizer_state(strategy: PrecisionStrategy) -> bool:
    """Whether `save_full_precision` exports what the optimizer keeps beside the weights: Collage's and
    Kahan's compensation, fp16-als's FP32 masters, fp8-lm-o2/o3's scaled FP16 masters. The others'
    export is the weights themselves (FP32 ones, or 16-bit ones widened)."""
    from ..strategies.collage import COMPENSATED_UPDATES

    options = strategy.options
    if getattr(options, "update", None) is not None:  # the BF16-weight family
        return options.update in COMPENSATED_UPDATES
    if getattr(options, "weights", None) is not None:  # fp16-als: "master" or "sr"
        return options.weights == "master"
    return torch.float16 in strategy.promised_param_dtypes()  # fp8-lm-o2/o3


def refuse_export_of_a_model_only_best(args: Any, strategy: PrecisionStrategy) -> None:
    """`load_best_model_at_end` loads the best checkpoint's optimizer state with its weights: the masters
    and Collage's δθ that `save_full_precision` exports. A model-only checkpoint has none, so the final
    export would be the best weights with the last step's state, a model that never was."""
    beyond = _exports_optimizer_state(strategy)
    if strategy.options.save_full_precision and beyond and args.load_best_model_at_end and args.save_only_model:
        raise ValueError(
            f"precision_options save_full_precision=True with precision_strategy={strategy.name!r}, "
            "load_best_model_at_end=True and save_only_model=True: the best checkpoint would hold the "
            "weights without the optimizer state the full-precision export is made of (masters, δθ), so "
            "the final export would mix the best step's weights with the last step's state. Drop "
            "save_only_model (the checkpoints then hold the optimizer), or drop save_full_precision"
        )


def trial_params(trainer: Any, trial: Any) -> dict:
    """The hyperparameters of `trial` as the stock `_hp_search_setup` reads them (`hp_space(trial)` under
    Optuna, the trial's dict under Ray and W&B), computed once per trial; {} outside a search."""
    if getattr(trainer, "hp_search_backend", None) is None or trial is None:
        return {}
    cached = getattr(trainer, "_hf_lowprec_trial", (None, None))
    if cached[0] is trial:
        return cached[1]
    if HPSearchBackend(trainer.hp_search_backend) == HPSearchBackend.OPTUNA:
        params = dict(trainer.hp_space(trial))
    else:
        params = {key: value for key, value in trial.items() if key != "wandb"}
    trainer._hf_lowprec_trial = (trial, params)
    return params


def trial_precision(trainer: Any, trial: Any) -> PrecisionStrategy | None:
    """The strategy of `trial`'s arguments, checked as the TrainingArguments check them (with the trial's
    other values: `bf16`, `optim`, ...), its `precision_strategy`/`precision_options` set on the
    trainer's arguments; None outside a search, or when the trainer has no strategy."""
    params = trial_params(trainer, trial)
    searched = sorted(set(PRECISION_FIELDS) & set(params))
    if getattr(trainer, "precision", None) is None:
        if searched:
            raise ValueError(
                f"hp_space sets {', '.join(searched)}, but the Trainer was built without a precision_strategy; "
                "set precision_strategy in TrainingArguments (any of the search's) so the Trainer is built with one"
            )
        return None
    if not params:
        return None
    if searched and (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
        raise ValueError(
            f"hp_space sets {', '.join(searched)} under {'DeepSpeed' if trainer.is_deepspeed_enabled else 'FSDP'}, "
            "whose setup for the strategy ran once, when the Trainer was built: search the precision in "
            "separate runs"
        )
    trial_args = copy.copy(trainer.args)
    for key, value in params.items():  # as the stock _hp_search_setup sets them, the precision ones as given
        old = getattr(trial_args, key, None)
        if hasattr(trial_args, key):
            setattr(trial_args, key, type(old)(value) if old is not None and key not in PRECISION_FIELDS else value)
    strategy = check_precision_arguments(trial_args)
    if strategy is None:
        raise ValueError(
            "hp_space sets precision_strategy=None, but the Trainer was built with a strategy, whose optimizer "
            "and callbacks it keeps; search without a strategy in a Trainer built without one"
        )
    for key in PRECISION_FIELDS:
        setattr(trainer.args, key, getattr(trial_args, key))
    trainer._hf_lowprec_trial_applied = trial
    return strategy


def setup_trial(trainer: Any, trial: Any, stock_setup: Any) -> None:
    """The stock `_hp_search_setup(trial)` (`stock_setup`), given the trial's values less the precision
    ones `trial_precision` set before the model was built; then `bf16`/`fp16` a trial set reconciled."""
    params = trial_params(trainer, trial)
    searched = sorted(set(PRECISION_FIELDS) & set(params))
    if searched and getattr(trainer, "_hf_lowprec_trial_applied", None) is not trial:
        raise ValueError(
            f"hp_space sets {', '.join(searched)}, but the model was not built for the trial: a search over "
            "the precision needs model_init=, whose model each trial's strategy prepares"
        )
    rest = {key: value for key, value in params.items() if key not in PRECISION_FIELDS}
    if not params:
        stock_setup(trial)
    elif HPSearchBackend(trainer.hp_search_backend) == HPSearchBackend.OPTUNA:
        hp_space = trainer.hp_space
        trainer.hp_space = lambda _trial: rest
        try:
            stock_setup(trial)
        finally:
            trainer.hp_space = hp_space
    else:
        stock_setup(rest)
        trainer._trial = trial
    if getattr(trainer, "precision", None) is not None and params:
        reconcile_mixed_precision_flags(trainer.args, trainer.precision)  # (checked in trial_precision)
