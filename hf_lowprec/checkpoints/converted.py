"""Load a Trainer checkpoint into the model being trained as the stock loaders do not.

MoE experts, fused in the model, are written per expert (transformers#48805, docs/checkpoints.md):
`to_model_keys` runs the conversion forwards, `load_in_model_format` loads through it. PEFT's adapter
load turns 16-bit adapters to FP32 (`keeping_dtypes`). `load_best_model`: the best checkpoint whole.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["keeping_dtypes", "load_best_model", "load_in_model_format", "to_model_keys"]

logger = logging.getLogger(__name__)


def _conversions(model: Any) -> list[Any]:
    """The conversions `save_pretrained` reverts for `model` (as `revert_weight_conversion` finds them)."""
    from transformers.core_model_loading import PrefixChange

    found = getattr(model, "_weight_conversions", None)
    if found is None:
        from transformers.conversion_mapping import get_model_conversion_mapping

        found = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return list(found or [])


def to_model_keys(model: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` in the hub format (what `save_pretrained` wrote) as `model`'s own state dict:
    `revert_weight_conversion` run forwards (renamings, then at most one converter per key)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    conversions = _conversions(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    mappings: dict[str, Any] = {}
    # Natural order: expert 10 after expert 9, so the converters stack the experts in order.
    for key, tensor in sorted(state_dict.items(), key=lambda kv: dot_natural_key(kv[0])):
        target, pattern = rename_source_key(key, renamings, converters)
        if pattern is not None:
            mapping = mappings.setdefault(target, copy.deepcopy(by_pattern[pattern]))
        else:
            mapping, pattern = mappings.setdefault(target, WeightRenaming(key, target)), key
        mapping.add_tensor(target, key, pattern, tensor)
    out = {}
    for first, mapping in mappings.items():
        for name, value in mapping.convert(first, model=model, config=model.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


def load_in_model_format(trainer: Any, checkpoint: str, model: Any = None) -> bool:
    """Load the weights of the Trainer checkpoint `checkpoint` into `model` (the trainer's
    model if None) through `to_model_keys`, then the Trainer's missing/unexpected key warnings.

    Returns False, loading nothing, where the stock loader is right: the model has no key
    conversion, or is not a plain `PreTrainedModel` (PEFT), FSDP or DeepSpeed load their own
    way, the weights are not safetensors, or the checkpoint holds the model's own keys.
    """
    import safetensors.torch
    from transformers import PreTrainedModel

    model = trainer.model if model is None else model
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        return False
    if not isinstance(model, PreTrainedModel) or not _conversions(model):
        return False
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(checkpoint, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        return False
    state: dict[str, torch.Tensor] = {}
    for name in files:  # every shard: one layer's experts may straddle two
        state.update(safetensors.torch.load_file(os.path.join(checkpoint, name), device="cpu"))
    # The model's own keys, from its parameters and buffers: `state_dict()` would run the export
    # hooks (FP32 copies of every scaled master) only to name them.
    own = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    if set(state) <= own:
        return False
    trainer._issue_warnings_after_load(model.load_state_dict(to_model_keys(model, state), strict=False))
    return True


@contextlib.contextmanager
def keeping_dtypes(model: torch.nn.Module) -> Iterator[None]:
    """The trainable parameters leave the scope in the dtypes they entered it in. PEFT's
    `load_adapter` (the stock resume and best-model load of a PEFT model) upcasts 16-bit adapters
    to FP32 (`autocast_adapter_dtype`), where a strategy keeps them in its parameter dtype; the
    values it loads are the checkpoint's 16-bit ones, so the cast back is exact."""
    before = {name: p.dtype for name, p in model.named_parameters() if p.requires_grad}
    yield
    for name, param in model.named_parameters():
        if name in before and param.dtype != before[name] and param.is_floating_point():
            param.data = param.data.to(before[name])


def load_best_model(trainer: Any, stock: Callable[[], None]) -> None:
    """`load_best_model_at_end` under a strategy: the best checkpoint's weights (MoE experts merged
    back, adapters in their dtypes), then its optimizer state (and schedule), which holds what the
    weights alone do not (masters, Collage's δθ): `save_full_precision`'s final export is the best's."""
    best = trainer.state.best_model_checkpoint
    with keeping_dtypes(trainer.model):
        if not load_in_model_format(trainer, best):
            stock()
    if getattr(trainer, "is_deepspeed_enabled", False):
        return  # DeepSpeed's loader restored the optimizer's partitions with the weights
    fsdp = getattr(trainer, "is_fsdp_enabled", False)
    if trainer.optimizer is None or not (fsdp or os.path.isfile(os.path.join(best, "optimizer.pt"))):
        logger.warning(
            "%s holds no optimizer.pt: the strategy's state beyond the weights (masters, δθ) stays the last "
            "step's, and a save_full_precision export would not be the best checkpoint's",
            best,
        )
        return
    # The Trainer's own loader (its device rules, FSDP's sharded optimizer), with no part of the
    # best checkpoint reset: `resume_reset` spoke of the checkpoint this run resumed from.
    resets, trainer._resume_resets = getattr(trainer, "_resume_resets", set()), set()
    try:
        trainer._load_optimizer_and_scheduler(best)
    finally:
        trainer._resume_resets = resets
