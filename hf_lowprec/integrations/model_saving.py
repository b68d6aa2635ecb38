"""The weights the Trainer's `save_model` writes under a strategy: its export, or with
`save_full_precision` the FP32 weights its optimizer holds (θ + δθ, the masters), under DeepSpeed
gathered from the ZeRO partitions (`engines.zero_export`), under FSDP from the shards onto rank 0
(`full_precision_state_dict`). The config says `dtype: float32` when every floating tensor
written is FP32, or FP32 trained ones sit beside 16-bit frozen ones (`all_fp32`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import transformers

from ..checkpoints.complete_save import gather_export, with_export

__all__ = [
    "all_fp32",
    "gather_for_save",
    "label_full_precision",
    "refuse_unwritten_export",
    "sharded_fsdp_export",
    "weights_to_save",
]

logger = logging.getLogger(__name__)


def _full(trainer: Any) -> bool:
    return trainer.precision is not None and trainer.precision.options.save_full_precision


def _fsdp_full(trainer: Any) -> bool:
    return _full(trainer) and getattr(trainer, "is_fsdp_enabled", False)


def sharded_fsdp_export(trainer: Any) -> bool:
    """Whether `save_full_precision` runs under FSDP's sharded state dict, where the stock
    `save_model` writes no model file: the Trainer then writes the gathered FP32 export itself."""
    return _fsdp_full(trainer) and "FULL_STATE_DICT" not in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)


def gather_for_save(trainer: Any) -> dict[str, Any] | None:
    """Under DeepSpeed, or FSDP with `save_full_precision`, what replaces the model's weights in
    the save (None otherwise). A collective: every rank runs it in `save_model` (transformers
    before 5.23 calls the Trainer's `_save` on the saving rank only)."""
    if _fsdp_full(trainer):  # rank 0 gets every FP32 weight, the other ranks an empty dict
        return trainer.precision.full_precision_state_dict(trainer.model, trainer.optimizer)
    if trainer.precision is None or not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    if not _full(trainer):
        return gather_export(trainer.precision, trainer.model, trainer.optimizer)
    from ..engines.zero_export import gather_full_precision

    zero = getattr(trainer.model_wrapped, "optimizer", None)
    return gather_full_precision(trainer.precision, trainer.model, trainer.optimizer, zero, trainer.args.should_save)


def weights_to_save(trainer: Any, state_dict: dict | None, gathered: dict[str, Any] | None) -> dict | None:
    """The state dict the stock `_save` writes: `state_dict` (None: the model's own) as the strategy
    exports it, or in full precision; `gathered` is `gather_for_save`'s (None: gathered now)."""
    deepspeed = getattr(trainer, "is_deepspeed_enabled", False)
    if _full(trainer) and deepspeed:  # DeepSpeed's 16-bit weights, with the optimizer's full precision
        from ..engines.zero_export import in_full_precision

        gathered = gathered if gathered is not None else gather_for_save(trainer)
        if not trainer.args.should_save:
            return state_dict  # (ZeRO-3 gathers DeepSpeed's weights to the saving rank only: None)
        return in_full_precision(trainer.model.state_dict() if state_dict is None else state_dict, gathered)
    if _fsdp_full(trainer):  # gathered onto rank 0, the saving rank, by every rank in save_model
        return gathered if gathered is not None else state_dict
    if _full(trainer) and state_dict is None:
        if _optimizer_holds_model(trainer):
            return trainer.precision.full_precision_state_dict(trainer.model, trainer.optimizer)
        logger.warning(
            "save_full_precision: the optimizer holds none of the parameters of the model being saved (%s, "
            "set as trainer.model after training, e.g. by merge_and_unload), so there is no full-precision "
            "value to write: its weights are saved as it holds them. Save before replacing the model (the "
            "adapter, under PEFT) to keep the optimizer's FP32 values.",
            type(trainer.model).__name__,
        )
    if trainer.precision is not None and (deepspeed or trainer.args.world_size == 1):
        # Gathered by every rank in save_model under DeepSpeed; else only one process may gather.
        return with_export(trainer.precision, trainer.model, trainer.optimizer, state_dict, gathered)
    return state_dict


def _optimizer_holds_model(trainer: Any) -> bool:
    """Whether some parameter of `trainer.model` is one the optimizer updates (no optimizer: True,
    the strategy's export then decides)."""
    from ..memory import unwrap_optimizer

    if trainer.optimizer is None:
        return True
    held = {id(p) for g in unwrap_optimizer(trainer.optimizer).param_groups for p in g["params"]}
    return any(id(p) in held for p in trainer.model.parameters())


def all_fp32(trainer: Any, state_dict: dict | None) -> bool:
    """Whether a save must say `dtype: float32` in the config (read before the stock save:
    save_pretrained takes tensors out of the dict as it writes them): a `save_full_precision` save
    of FP32 weights only, or a strategy with FP32 parameters whose model holds 16-bit frozen ones
    beside them (a BF16 load partly frozen), for which save_pretrained would record the first
    parameter's dtype, and a stock load would round the trained FP32 weights to it."""
    if state_dict is None and trainer.precision is not None and trainer.precision.param_dtype == torch.float32:
        state_dict = dict(trainer.model.named_parameters())
    dtypes = {v.dtype for v in (state_dict or {}).values() if torch.is_tensor(v) and v.is_floating_point()}
    if _full(trainer):
        return dtypes == {torch.float32}
    precision = trainer.precision
    fp32_params = precision is not None and precision.param_dtype == torch.float32
    return fp32_params and torch.float32 in dtypes and bool(dtypes & {torch.bfloat16, torch.float16})


def label_full_precision(trainer: Any, output_dir: str | None) -> None:
    """After a save `all_fp32` named: `dtype: float32` in the config, where save_pretrained
    recorded the first parameter's dtype (BF16)."""
    if trainer.args.should_save and isinstance(trainer.model, transformers.PreTrainedModel):
        config = trainer.model.config.__class__.from_dict(trainer.model.config.to_dict())
        config.dtype = "float32"
        config.save_pretrained(output_dir if output_dir is not None else trainer.args.output_dir)


def refuse_unwritten_export(strategy: Any, deepspeed_config: dict[str, Any], model: Any) -> None:
    """Before any work under DeepSpeed (`deepspeed_config` as Accelerate filled it): at ZeRO-3 the
    FP32 export replaces the model file DeepSpeed gathers on save, and without
    `stage3_gather_16bit_weights_on_model_save` it writes none (a PEFT model's adapter excepted:
    transformers gathers that regardless), so the export would be computed and dropped."""
    from .peft import is_peft_model

    zero = deepspeed_config.get("zero_optimization", {})
    if not strategy.options.save_full_precision or int(zero.get("stage", 0)) != 3 or is_peft_model(model):
        return
    keys = ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")
    if any(str(zero.get(key)).lower() == "true" for key in keys):
        return
    raise ValueError(
        f"precision_options save_full_precision=True with precision_strategy={strategy.name!r} under DeepSpeed "
        "ZeRO stage 3: the FP32 export replaces the model file DeepSpeed gathers on save, and it writes none "
        "unless zero_optimization.stage3_gather_16bit_weights_on_model_save is true; set it to true, or drop "
        "save_full_precision"
    )
