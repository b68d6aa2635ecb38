"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for precision strategies: `shard_model` for a
custom loop, the steps the Trainer's and Accelerate's own `fully_shard` calls run around them
(`configure_accelerator`, `before_sharding`, `adopt_shards`, `move_state_to_shards`), and which
strategies FSDP2 carries.

The custom loop, the policy and the optimizer state per shard, what agrees across ranks, the
refusals and the sharded checkpoints (`save_sharded`, `load_sharded`): docs/distributed.md, "FSDP2".
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..checkpoints.distributed_checkpoint import load_sharded, save_sharded, sharded_state_dict
from ..distributed import DTensor, all_ranks_agree, local_shard, mark_sharded_by, written_since, written_version
from ..strategies.registry import available_strategies, get_strategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..strategies.interface import PrecisionStrategy

__all__ = [
    "adopt_shards",
    "before_sharding",
    "block_modules",
    "all_ranks_agree",
    "check_fsdp2_support",
    "check_trainer_fsdp",
    "configure_accelerator",
    "default_mesh",
    "fsdp2_support",
    "is_sharded",
    "load_sharded",
    "local_shard",
    "move_state_to_shards",
    "refuse_full_precision_save",
    "residuals_by_name",
    "save_sharded",
    "shard_model",
    "sharded_state_dict",
    "support_matrix_markdown",
    "warn_if_fsdp_fell_back",
]

logger = logging.getLogger(__name__)


# --- what runs under FSDP2 ------------------------------------------------------------------------
# Declared on the strategy class (`support`: `fsdp2`, `fsdp2_refusal`, `fsdp2_note`); the check in
# `shard_model`, Accelerate's and the Trainer's paths and `support_matrix_markdown` read that one source.
def fsdp2_support(strategy: PrecisionStrategy) -> str | None:
    """None when `strategy` trains under FSDP2 with its numerics, else the refusal message
    (why, and what works instead)."""
    support = strategy.engine_support()
    if support.fsdp2:
        return None
    working = ", ".join(n for n in available_strategies() if get_strategy(n).engine_support().fsdp2)
    return (
        f"precision strategy {strategy.name!r} is not supported under FSDP2 (fully_shard): "
        f"{support.fsdp2_refusal}. Strategies that train under FSDP2: {working}"
    )


def check_fsdp2_support(strategy: PrecisionStrategy) -> None:
    """Raise ValueError with `fsdp2_support`'s message when the strategy is refused."""
    message = fsdp2_support(strategy)
    if message is not None:
        raise ValueError(message)


def support_matrix_markdown(names: Iterable[str] | None = None) -> str:
    """The FSDP2 column of the support matrix as a markdown table, from the same declarations."""
    names = available_strategies() if names is None else list(names)
    lines = ["| strategy | FSDP2 | under FSDP2 |", "|---|---|---|"]
    for name in names:
        support = get_strategy(name).engine_support()
        ok = support.fsdp2
        lines.append(f"| `{name}` | {'yes' if ok else 'no'} | {support.fsdp2_note if ok else support.fsdp2_refusal} |")
    return "\n".join(lines) + "\n"


# --- sharding --------------------------------------------------------------------------------------
def is_sharded(model: torch.nn.Module) -> bool:
    """True when some parameter of `model` is a DTensor (already sharded by `fully_shard`)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def default_mesh(model: torch.nn.Module) -> DeviceMesh:
    """A 1-D mesh over every rank of the default process group, on the model's device type."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "FSDP2 needs an initialized process group: call torch.distributed.init_process_group(...) "
            "(or launch with torchrun / accelerate launch) before sharding the model"
        )
    param = next(model.parameters(), None)
    device_type = param.device.type if param is not None else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def block_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: modules whose class a Hugging Face model names in `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def shard_model(
    strategy: PrecisionStrategy,
    model: torch.nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    blocks: Iterable[torch.nn.Module] | None = None,
    prepared: bool = False,
    **fully_shard_kwargs: Any,
) -> torch.nn.Module:
    """Convert `model` for `strategy` and shard it with FSDP2; returns the model to train.

    Every rank calls this with the same model (same initialization). Steps: refuse a strategy
    that FSDP2 does not support (before any work); `strategy.prepare_model(model)` unless
    `prepared` (then the caller did it, e.g. `hf_lowprec.PrecisionPlugin.prepare_model`); `fully_shard` on
    each block (default: the modules a Hugging Face model lists in `_no_split_modules`, e.g.
    `GPT2Block`), then on the root, with `strategy.fsdp2_mixed_precision()` as the policy; the
    FP32 residuals a compensated strategy kept for δθ move onto the new (sharded) parameters.
    Build the optimizer afterwards, from the sharded `model.parameters()`.

    Args:
        mesh: a 1-D device mesh (default: every rank, the parameters' device type).
        blocks: the modules to shard one by one (their parameters are gathered per block).
        **fully_shard_kwargs: passed to `fully_shard` (e.g. `reshard_after_forward`); not
            `mp_policy`, which the strategy owns.
    """
    from torch.distributed.fsdp import fully_shard

    check_fsdp2_support(strategy)
    if "mp_policy" in fully_shard_kwargs:
        raise ValueError(
            f"precision strategy {strategy.name!r} owns FSDP2's mixed precision "
            f"({strategy.fsdp2_mixed_precision()}); drop mp_policy= from the shard call"
        )
    if "offload_policy" in fully_shard_kwargs:
        raise ValueError(
            "offload_policy is not supported by the precision strategies' FSDP2 path (optimizer states "
            "are created on the parameters' device); drop offload_policy="
        )
    if is_sharded(model):
        raise ValueError("the model is already sharded (DTensor parameters); pass the unsharded model")
    mesh = default_mesh(model) if mesh is None else mesh
    if mesh.ndim != 1:
        raise ValueError(f"shard_model takes a 1-D device mesh (pure FSDP), got a {mesh.ndim}-D mesh")
    if not prepared:
        model = strategy.prepare_model(model)
    residuals = residuals_by_name(strategy, model)
    before_sharding(strategy, model)
    # The policies, as parameters (DTensor shards) -> all-gather; every family reduce-scatters in FP32:
    #   fp32: FP32, no policy -> FP32 all-gather and reduce-scatter
    #   bf16-mixed: FP32 masters, param_dtype=bf16 -> BF16 all-gather
    #   BF16 family (collage-*, bf16-*): BF16 -> BF16 all-gather; gradients averaged in FP32, rounded once
    #   fp16-mixed: FP32 masters -> FP32 all-gather (autocast casts to FP16 in the GEMMs)
    #   fp16-als (weights="master"): FP16 -> FP16 all-gather
    #   coat: FP32 (or BF16 + δθ) -> FP32 (BF16) all-gather; FP8 weight scales from the gathered weight
    policy = strategy.fsdp2_mixed_precision()
    block_list = list(block_modules(model) if blocks is None else blocks)
    for block in block_list:
        fully_shard(block, mesh=mesh, mp_policy=policy, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, mp_policy=policy, **fully_shard_kwargs)
    adopt_shards(strategy, model, residuals)
    return model


def before_sharding(strategy: PrecisionStrategy, model: torch.nn.Module, optimizers: Iterable[Any] = ()) -> None:
    """The strategy's own step before `fully_shard` (FP8-LM wraps its FP8 weights so that they
    all-gather as FP8: `hf_lowprec.fp8.sharded_weight`); nothing for the others. A parameter the
    step replaces is replaced in `optimizers` too (built before sharding, no step taken yet)."""
    from ..fp8.blocks import FrozenBlockFP8Linear

    if any(isinstance(m, FrozenBlockFP8Linear) for m in model.modules()):
        raise ValueError(
            "FSDP2 does not shard a frozen FP8 base kept as published (E4M3 payload + block scales) yet: "
            "its mixed-precision all-gather would cast the scales; train this LoRA run under DDP, or with a "
            "strategy that dequantizes the base (any but fp8-lm-o1/o2/o3)"
        )
    hook = getattr(strategy, "before_sharding", None)
    if hook is None:
        return
    old = dict(model.named_parameters(remove_duplicate=False))
    hook(model)
    new = dict(model.named_parameters(remove_duplicate=False))
    replaced = {id(old[n]): p for n, p in new.items() if old[n] is not p}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]


def residuals_by_name(strategy: PrecisionStrategy, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The FP32 residuals a compensated strategy kept for δθ (keyed by the parameters, which
    sharding replaces), keyed by parameter name: take them before `fully_shard`."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    kept = getattr(strategy, "_residuals", {}).items()
    # One written since prepare_model (a load, a resize) no longer goes with the weight: it is left behind.
    return {
        names[key]: r
        for key, (p, r, version) in kept
        if key in names and not written_since(p, version) and r.shape == p.shape
    }


def adopt_shards(strategy: PrecisionStrategy, model: torch.nn.Module, residuals: dict[str, torch.Tensor]) -> None:
    """After `fully_shard` (ours, Accelerate's or the Trainer's): the parameters carry the
    strategy's name (so `create_optimizer` takes them), the residuals (`residuals_by_name`)
    move onto the shards, and the strategy re-points what it keyed on the old parameters."""
    mark_sharded_by(model.parameters(), strategy.name)
    strategy.after_sharding(model)
    if residuals:
        strategy._residuals.clear()
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in residuals:
                strategy._residuals[id(param)] = (
                    param,
                    _shard_like(residuals[name], param),
                    written_version(param),
                )


def _shard_like(tensor: torch.Tensor, param: Any) -> Any:
    """`tensor` (the full value on every rank) cut into the shard `param` (a DTensor) holds here."""
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank has the full tensor and keeps its own chunk (no communication);
    # FSDP2 and `distribute_tensor` cut dim 0 the same way (torch.chunk, padded last shards).
    out = distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    if out.to_local().shape != param.to_local().shape:
        raise RuntimeError(
            f"residual shard {tuple(out.to_local().shape)} does not match the parameter shard "
            f"{tuple(param.to_local().shape)}"
        )
    return out


# --- Accelerate (`fsdp_version: 2`) --------------------------------------------------------------
_FALLBACK_WARNED: list[bool] = []


def warn_if_fsdp_fell_back(accelerator: Any) -> str | None:
    """Warn once per process when the launch asked for FSDP (`distributed_type: FSDP`, e.g.
    recipes/configs/fsdp2.yaml) but Accelerate runs without it: Accelerate takes its FSDP path
    only on accelerators, and on a CPU-only machine silently trains plain data parallel. The
    warning's text, or None when there is nothing to say (or it was said already)."""
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes")
    if not asked or getattr(getattr(accelerator, "state", None), "fsdp_plugin", None) is not None or _FALLBACK_WARNED:
        return None
    _FALLBACK_WARNED.append(True)
    text = (
        "the Accelerate config asks for FSDP, but Accelerate takes its FSDP path only on accelerators "
        "(CUDA/XPU/NPU): on this machine every rank trains a full replica (plain data parallel, no "
        "sharding). For FSDP2 on CPU, shard in the loop: PrecisionPlugin(...).shard(model) or "
        "hf_lowprec.engines.fsdp2.shard_model (docs/distributed.md)"
    )
    logger.warning("hf_lowprec: %s", text)
    return text


def configure_accelerator(
    strategy: PrecisionStrategy,
    accelerator: Any,
    model: torch.nn.Module | None = None,
    optimizers: Iterable[Any] = (),
) -> None:
    """Before `accelerator.prepare` under Accelerate's FSDP plugin: refuse what cannot work
    (a refused strategy, FSDP1, CPU offload, a mixed-precision policy of the user's), give
    Accelerate's `fully_shard` calls the strategy's `MixedPrecisionPolicy` and run the
    strategy's step before sharding on `model` (`before_sharding`; FP8-LM's FP8 all-gather)."""
    plugin = accelerator.state.fsdp_plugin
    check_fsdp2_support(strategy)
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            f"precision strategy {strategy.name!r} runs under FSDP2 only; set fsdp_version: 2 in the "
            "Accelerate config (fsdp_config) or FullyShardedDataParallelPlugin(fsdp_version=2)"
        )
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy):
        raise ValueError("FSDP CPU offload is not supported with a precision strategy; set fsdp_offload_params: false")
    ours = strategy.fsdp2_mixed_precision()
    theirs = getattr(plugin, "mixed_precision_policy", None)
    if theirs is not None and theirs != ours:
        raise ValueError(
            f"precision strategy {strategy.name!r} owns FSDP2's mixed precision ({ours}); drop "
            f"mixed_precision_policy ({theirs}) from the FSDP plugin"
        )
    plugin.mixed_precision_policy = ours
    if model is not None:
        before_sharding(strategy, model, optimizers)


def move_state_to_shards(optimizer: Any, before: list[torch.Tensor]) -> None:
    """Move state created before sharding (a seeded δθ) onto the shards that replaced the
    optimizer's parameters (`before`: the parameters in `param_groups` order, as they were).

    Accelerate's FSDP2 `prepare` swaps each parameter for its DTensor shard in place in the
    groups but leaves the state keyed by the old tensors; the first step would then start the
    shards' state at zero and the seeded compensation would be lost silently."""
    from ..memory import unwrap_optimizer

    inner = unwrap_optimizer(optimizer)
    after = [p for group in inner.param_groups for p in group["params"]]
    mark_sharded_by(after, optimizer.strategy.name)
    if len(after) != len(before):
        raise RuntimeError(f"the optimizer had {len(before)} parameters before sharding and {len(after)} after")
    for old, new in zip(before, after):
        if old is new or old not in inner.state:
            continue
        state = inner.state.pop(old)
        # What the optimizer would create for the shard: a DTensor where the state follows the
        # parameter's elements (cut it), a per-shard layout (groups, blocks) where it does not.
        plan = inner.plan_state(new) if hasattr(inner, "plan_state") else {}
        moved = {}
        for key, value in state.items():
            per_shard = key in plan and torch.is_tensor(plan[key]) and plan[key].dim() > 0
            per_shard = per_shard and not isinstance(plan[key], DTensor)
            if per_shard:
                # Exact only while the state still holds its starting value (no step taken).
                if state.get("step", 0) != 0:
                    raise RuntimeError(
                        f"optimizer state {key!r} is laid out over the whole tensor and has taken steps; "
                        "shard the model before training (it cannot be cut into shards)"
                    )
                moved[key] = plan[key]
            elif torch.is_tensor(value) and value.shape == new.shape:
                moved[key] = _shard_like(value, new)
            else:
                moved[key] = value
        inner.state[new] = moved
        if hasattr(inner, "move_written"):  # a write before the next step is still seen on the shard
            inner.move_written(old, new)


# --- checkpoints -----------------------------------------------------------------------------------


def _several_nodes() -> bool:
    """Launched on more than one node, or maybe (torchrun and `accelerate launch` set both variables;
    a launcher that sets no LOCAL_WORLD_SIZE may have spread the ranks over several)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def refuse_full_precision_save(strategy: PrecisionStrategy, save_on_each_node: bool) -> None:
    """`save_full_precision` under the Trainer's FSDP on several nodes: the FP32 export is gathered onto
    rank 0 (`full_precision_state_dict`), so the other nodes' first ranks would have nothing to write.
    On one node, `save_on_each_node` saves on rank 0 alone, as without it."""
    if strategy.options.save_full_precision and save_on_each_node and _several_nodes():
        raise ValueError(
            f"precision_options save_full_precision=True with precision_strategy={strategy.name!r} and "
            "save_on_each_node=True under FSDP on several nodes: the FP32 export is gathered onto rank 0 "
            "only, so the other nodes would write none. Drop save_on_each_node (rank 0 writes the model), "
            "or drop save_full_precision"
        )


def check_trainer_fsdp(strategy: PrecisionStrategy, fsdp: Any, fsdp_config: Any, save_on_each_node: bool) -> None:
    """Before any work (TrainingArguments): the strategy trains under FSDP2, and the Trainer's FSDP is version 2."""
    check_fsdp2_support(strategy)
    refuse_full_precision_save(strategy, save_on_each_node)
    if isinstance(fsdp_config, str) and fsdp_config:  # a JSON file, read as the Trainer reads it
        try:
            with open(fsdp_config, encoding="utf-8") as f:
                fsdp_config = json.load(f)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"fsdp_config={fsdp_config!r} cannot be read as a JSON file ({type(error).__name__}: {error}); "
                "pass the path of an existing JSON file, or a dict such as fsdp_config={'fsdp_version': 2}"
            ) from None
    version = (fsdp_config or {}).get("fsdp_version", (fsdp_config or {}).get("version", 1))
    try:
        number = None if isinstance(version, bool) else int(version)
    except (TypeError, ValueError):
        number = None
    if number not in (1, 2):
        raise ValueError(
            f"fsdp_config fsdp_version must be 1 or 2, got {version!r}; precision_strategy={strategy.name!r} "
            "runs under FSDP2: pass fsdp_config={'fsdp_version': 2}"
        )
    if number != 2:
        raise ValueError(
            f"precision_strategy={strategy.name!r} runs under FSDP2 only; pass "
            "fsdp_config={'fsdp_version': 2} (or set fsdp_version: 2 in the Accelerate config)"
        )
