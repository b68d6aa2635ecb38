"""DPO's and KTO's `precompute_ref_log_probs` under a strategy (`trl_trainers._FrozenModels`): put
off until the strategy prepared the model, cached under TRL's key and the strategy, computed in
the training forward's context by an inference engine built without the optimizer-only entries.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["OPTIMIZER_ONLY", "cache_key", "early_hash", "inference_config", "precompute", "run_deferred"]

# The `bf16` entries of a DeepSpeed config that only ZeRO's optimizer reads (`engines.zero.owned_entries`):
# DeepSpeed refuses them in a stage-0 engine, the one TRL builds to compute reference log-probs.
OPTIMIZER_ONLY = ("bf16_master_weights_and_grads", "bf16_optimizer_states")


@contextlib.contextmanager
def inference_config(accelerator: Any) -> Iterator[None]:
    """The accelerator's DeepSpeed config without `OPTIMIZER_ONLY` for the block (restored after)."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    config = plugin.deepspeed_config if plugin is not None else None
    section = config.get("bf16") if isinstance(config, dict) else None
    removed = {k: section.pop(k) for k in OPTIMIZER_ONLY if k in section} if isinstance(section, dict) else {}
    try:
        yield
    finally:
        if removed:
            section.update(removed)


def _stock(trainer_cls: type) -> type:
    return next(c for c in trainer_cls.__mro__ if c.__module__.startswith("trl."))


def early_hash(trainer_cls: type, arguments: dict[str, Any]) -> str | None:
    """TRL's hash of a passed reference, taken before TRL's `__init__` shards it, where TRL hashes
    only when it precomputes (1.13: the ZeRO-3 engine's empty partitions, FSDP2's DTensors)."""
    reference = arguments.get("ref_model")
    wanted = getattr(arguments.get("args"), "precompute_ref_log_probs", False) and hasattr(reference, "state_dict")
    if not wanted or "_precompute_model_hash" in _stock(trainer_cls).__init__.__code__.co_names:
        return None  # nothing to precompute, or TRL hashes in its __init__ (`cache_key`)
    from trl.trainer.utils import hash_module

    return hash_module(reference)


@contextlib.contextmanager
def _hashed_as(trainer: Any) -> Iterator[None]:
    # TRL 1.13 hashes in `_precompute_ref_logps` (its module's `hash_module`): the early hash, or
    # the policy's there, with the strategy added.
    module = sys.modules[_stock(type(trainer)).__module__]
    original = getattr(module, "hash_module", None)
    if hasattr(trainer, "_precompute_model_hash") or original is None:
        yield
        return
    early = trainer.__dict__.get("_hf_lowprec_early_hash")
    module.hash_module = lambda model: f"{early or original(model)}:{trainer.precision!r}"
    try:
        yield
    finally:
        module.hash_module = original


def cache_key(trainer: Any) -> None:
    """TRL's cache key for precomputed log-probs (TRL 1.16: a hash of the reference, or of the
    policy without one, taken in its `__init__` before it is sharded) with the strategy added;
    TRL's hash alone would give a run under another strategy the cached log-probs of this one."""
    trl_hash = getattr(trainer, "_precompute_model_hash", None)
    if isinstance(trl_hash, str):
        trainer._precompute_model_hash = f"{trl_hash}:{trainer.precision!r}"


def precompute(trainer: Any, stock: Any, dataset: Any, name: str, batch_size: int) -> Any:
    """`stock(dataset, name, batch_size)` (TRL's `_precompute_ref_logps`) under the strategy."""
    with trainer.compute_loss_context_manager(), inference_config(trainer.accelerator), _hashed_as(trainer):
        return stock(dataset, name, batch_size)


def run_deferred(trainer: Any, deferred: dict[int, tuple]) -> None:
    """Precompute the datasets whose precompute TRL's `__init__` asked for ({id: (name, batch_size)})."""
    cache_key(trainer)

    def computed(dataset: Any) -> Any:
        entry = deferred.get(id(dataset))
        return dataset if entry is None else trainer._precompute_ref_logps(dataset, *entry)

    trainer.train_dataset = computed(trainer.train_dataset)
    if isinstance(trainer.eval_dataset, dict):
        trainer.eval_dataset = {name: computed(dataset) for name, dataset in trainer.eval_dataset.items()}
    elif trainer.eval_dataset is not None:
        trainer.eval_dataset = computed(trainer.eval_dataset)
