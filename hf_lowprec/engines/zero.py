"""DeepSpeed ZeRO for precision strategies: the config entries a strategy owns (`precision_config`
fills and checks them before any training starts), which stages keep its numerics (read from the
strategy class's `support` declaration: `zero_stages`, `zero_refusal`, `zero_note`), and the
client optimizer's state on DeepSpeed's partitions. The rules: docs/distributed.md, "DeepSpeed ZeRO".

DeepSpeed itself is imported only where a function needs it (`require_deepspeed`).
"""

from __future__ import annotations

import base64
import copy
import json
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..strategies.registry import available_strategies, get_strategy
from .zero_skips import count_deepspeed_skips

if TYPE_CHECKING:
    from ..strategies.interface import PrecisionStrategy

__all__ = [
    "STAGES",
    "apply_precision_config",
    "attach_zero_optimizer",
    "check_zero_support",
    "configure_accelerator",
    "load_config",
    "move_state_to_partitions",
    "owned_entries",
    "partition_segments",
    "precision_config",
    "require_deepspeed",
    "support_matrix",
    "support_matrix_markdown",
    "zero_stage",
    "zero_support",
]

STAGES = (1, 2, 3)
_AUTO = "auto"


def require_deepspeed() -> Any:
    """`import deepspeed`, or an ImportError naming the extra to install."""
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError(
            "DeepSpeed is not installed; install the `deepspeed` extra (from a checkout: `pip install -e '.[deepspeed]'`)"
        ) from err
    return deepspeed


# --- the support matrix -------------------------------------------------------------------------
# Declared on the strategy class; the check, the Trainer's and Accelerate's paths and the matrix
# read that one source. fp8-lm-o3's own FP8 ZeRO (whole tensors per rank): `hf_lowprec.partition`.
def zero_support(strategy: PrecisionStrategy, stage: int) -> str | None:
    """None when `strategy` keeps its numerics under ZeRO `stage`, else the refusal message.

    The message says why and names a combination that works.
    """
    support = strategy.engine_support()
    if stage in support.zero_stages:
        return None
    hint = ""
    if support.zero_stages:
        hint = f"; it runs under ZeRO stage {' or '.join(str(s) for s in support.zero_stages if s)}"
    return (
        f"precision strategy {strategy.name!r} is not supported under DeepSpeed ZeRO stage {stage}: "
        f"{support.zero_refusal}{hint}"
    )


def check_zero_support(strategy: PrecisionStrategy, stage: int) -> None:
    """Raise ValueError with `zero_support`'s message when the combination is refused."""
    message = zero_support(strategy, stage)
    if message is not None:
        raise ValueError(message)


def support_matrix(names: Iterable[str] | None = None) -> dict[str, dict[int, str | None]]:
    """{strategy name: {stage: None (supported) or refusal message}} for ZeRO stages 1, 2, 3."""
    names = available_strategies() if names is None else list(names)
    strategies = {name: get_strategy(name) for name in names}  # names resolved here, at the edge
    return {name: {stage: zero_support(s, stage) for stage in STAGES} for name, s in strategies.items()}


def support_matrix_markdown(names: Iterable[str] | None = None) -> str:
    """The support matrix as a markdown table (README), from the same source as the check."""
    lines = [
        "| strategy | ZeRO-1 | ZeRO-2 | ZeRO-3 | under ZeRO |",
        "|---|---|---|---|---|",
    ]
    for name, row in support_matrix(names).items():
        support = get_strategy(name).engine_support()
        cells = ["yes" if row[s] is None else "no" for s in STAGES]
        note = support.zero_note if any(row[s] is None for s in STAGES) else support.zero_refusal
        lines.append(f"| `{name}` | {' | '.join(cells)} | {note} |")
    return "\n".join(lines) + "\n"


# --- the precision entries of a DeepSpeed config --------------------------------------------------
def owned_entries(strategy: PrecisionStrategy) -> dict[str, Any]:
    """The DeepSpeed config entries (dotted keys) the strategy decides, with its values.

    BF16 parameters (collage-*, bf16-pure, bf16-kahan, bf16-sr, bf16-fp32states) turn the three
    `bf16` entries on: the partition DeepSpeed hands to the strategy's optimizer is then the BF16
    weight itself (no FP32 master), so Collage's δθ and δv, Kahan's compensation and the
    stochastic-rounding state live in the partitioned optimizer state as in one process. FP32
    parameters (fp32, bf16-mixed, fp8-lm-o3's non-FP8 ones) keep them off; `fp16` is always off.
    """
    bf16 = _partition_dtype(strategy) == torch.bfloat16
    return {
        "bf16.enabled": bf16,
        "bf16.bf16_master_weights_and_grads": bf16,
        "bf16.bf16_optimizer_states": bf16,
        "fp16.enabled": False,
        "fp16.fp16_master_weights_and_grads": False,
        "zero_allow_untested_optimizer": True,
    }


def _partition_dtype(strategy: PrecisionStrategy) -> torch.dtype:
    # BF16 models keep BF16 partitions (no FP32 master); every other supported one keeps FP32.
    return torch.bfloat16 if strategy.param_dtype == torch.bfloat16 else torch.float32


def load_config(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as a dict (deep copy) from a dict, a JSON file path, a JSON string or
    a base64-encoded JSON string (as Accelerate's `HfDeepSpeedConfig` reads it)."""
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    text = str(source)
    if os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            return json.load(f)
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError:
        try:
            loaded = json.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):  # binascii.Error and JSONDecodeError are ValueErrors
            raise ValueError(
                f"DeepSpeed config {text!r} is neither a file, a JSON object nor base64-encoded JSON"
            ) from None
    if not isinstance(loaded, dict):
        raise ValueError(f"DeepSpeed config must be a JSON object, got {loaded!r}")
    return loaded


def zero_stage(config: Mapping[str, Any]) -> int:
    """`zero_optimization.stage` of a DeepSpeed config (0 when absent)."""
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage == _AUTO or isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    return stage


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _as_bool(value: Any) -> Any:
    # DeepSpeed configs written by hand carry "true"/"false" strings too.
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


_DTYPE_NAMES = {
    "fp32": "fp32",
    "float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
}


def _read_bf16_alias(config: dict[str, Any]) -> dict[str, Any]:
    # DeepSpeed reads "bf16", else its legacy name "bfloat16" (`get_bfloat16_config`): a lone
    # "bfloat16" section is the one it would read, so it is checked and filled as "bf16".
    if "bfloat16" in config and "bf16" not in config:
        config["bf16"] = config.pop("bfloat16")
    return config


def _check_config(strategy: PrecisionStrategy, config: Mapping[str, Any]) -> None:
    name = strategy.name
    stage = zero_stage(config)
    check_zero_support(strategy, stage)
    alias = "bfloat16" in config and "bf16" not in config
    for key, ours in owned_entries(strategy).items():
        value = _as_bool(_get(_read_bf16_alias(dict(config)), key))
        if value is None or value in (_AUTO, ours):
            continue
        key = "bfloat16" + key[4:] if alias and key.startswith("bf16.") else key
        raise ValueError(
            f"the DeepSpeed config sets {key}={value!r}, but precision strategy {name!r} needs "
            f'{key}={ours!r}: the strategy owns mixed precision; set it to {json.dumps(ours)} or "auto"'
        )
    if "optimizer" in config:
        raise ValueError(
            f'the DeepSpeed config has an "optimizer" section, but precision strategy {name!r} builds the '
            'optimizer; remove the "optimizer" section (keep "scheduler" if you want DeepSpeed\'s)'
        )
    accum = _get(config, "data_types.grad_accum_dtype")
    partition = "bf16" if _partition_dtype(strategy) == torch.bfloat16 else "fp32"
    if accum not in (None, _AUTO, partition):
        raise ValueError(
            f"the DeepSpeed config sets data_types.grad_accum_dtype={accum!r}, but precision strategy {name!r} "
            f"keeps {partition} gradients; remove data_types.grad_accum_dtype or set it to {partition!r}"
        )
    if _as_bool(_get(config, "torch_autocast.enabled")) is True:
        raise ValueError(
            f"the DeepSpeed config sets torch_autocast.enabled=true, but precision strategy {name!r} owns the "
            "forward's autocast (its report would say otherwise); remove torch_autocast or set enabled to false"
        )
    comm = _get(config, "communication_data_type")
    if comm not in (None, _AUTO, partition, "fp32"):  # reductions at least as wide as the partitions
        raise ValueError(
            f"the DeepSpeed config sets communication_data_type={comm!r}, but precision strategy {name!r} reduces "
            f"{partition} gradients; remove communication_data_type or set it to {partition!r} (or 'fp32')"
        )
    for offload in ("offload_optimizer", "offload_param"):
        device = _get(config, f"zero_optimization.{offload}.device")
        if device not in (None, "none", _AUTO):
            raise ValueError(
                f"the DeepSpeed config sets zero_optimization.{offload}.device={device!r}; offloading replaces "
                f"the optimizer of precision strategy {name!r} by DeepSpeedCPUAdam. Remove "
                f"zero_optimization.{offload}"
            )
    for legacy, current in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if _as_bool(_get(config, f"zero_optimization.{legacy}")) not in (None, False):  # DeepSpeed's older names
            raise ValueError(
                f"the DeepSpeed config sets zero_optimization.{legacy} (DeepSpeed's older name for "
                f"zero_optimization.{current}); offloading replaces the optimizer of precision strategy {name!r} "
                f"by DeepSpeedCPUAdam. Remove zero_optimization.{legacy}"
            )


def precision_config(strategy: PrecisionStrategy, config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `config` with the strategy's precision entries filled; ValueError on a contradiction.

    Raises before any work when: the ZeRO stage is refused for the strategy; an owned entry is
    set to another value than the strategy's (e.g. `fp16.enabled: true` with collage-plus);
    the config has its own `optimizer`; `data_types.grad_accum_dtype` differs from the
    strategy's partitions; optimizer or parameter offload is on.
    """
    out = load_config(config)
    _check_config(strategy, out)
    _read_bf16_alias(out)
    for key, value in owned_entries(strategy).items():
        _set(out, key, value)
    return out


def apply_precision_config(
    strategy: PrecisionStrategy, target: dict[str, Any], original: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Check `original` (the user's config, before any "auto" was filled) and write the strategy's
    entries into `target` in place (a config a framework is already filling). Returns `target`."""
    _check_config(strategy, target if original is None else original)
    _read_bf16_alias(target)
    for key, value in owned_entries(strategy).items():
        _set(target, key, value)
    return target


# --- framework glue ---------------------------------------------------------------------------------
_FLAG_KEYS = ("bf16.enabled", "fp16.enabled")


def configure_accelerator(
    strategy: PrecisionStrategy, accelerator: Any, original: str | os.PathLike | Mapping[str, Any] | None = None
) -> None:
    """Write the strategy's entries into the config of `accelerator`'s DeepSpeed plugin (no-op without one).

    `original` is the user's config before transformers/Accelerate filled its "auto" entries
    (the Trainer's `deepspeed` argument); without it, the file `accelerate launch` names, else the
    plugin's config, where `bf16.enabled`/`fp16.enabled` were already filled from
    `mixed_precision="no"` and so are not held against the strategy.
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    hf_config = plugin.hf_ds_config
    env_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if original is None and env_file and os.path.isfile(env_file):
        original = env_file
    if original is None:
        original = load_config(hf_config.config)
        # Accelerate filled the flags from its mixed_precision, which the arguments have checked
        # against the strategy (optimizer_arguments.reconcile_launched_mixed_precision).
        launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no") not in ("", "no")
        for key in _FLAG_KEYS:
            if _get(original, key) is False or (launched and _get(original, key) is not None):
                _set(original, key, _AUTO)
    apply_precision_config(strategy, hf_config.config, load_config(original))
    # transformers compared bf16.enabled/fp16.enabled with --bf16/--fp16, which the strategy
    # turned off; the strategy has checked those entries itself.
    mismatches = getattr(hf_config, "mismatches", None)
    if mismatches:
        hf_config.mismatches = [m for m in mismatches if not m.startswith(tuple(f"- ds {k}=" for k in _FLAG_KEYS))]
    if hasattr(hf_config, "_dtype"):
        hf_config._dtype = _partition_dtype(strategy)


def partition_segments(zero_optimizer: Any) -> list[tuple[torch.Tensor, list[tuple[torch.Tensor, int, int, int]]]]:
    """[(partition, [(parameter, start in parameter, start in partition, length)])] on this rank."""
    import torch.distributed as dist

    out = []
    if hasattr(zero_optimizer, "single_partition_of_fp32_groups"):  # ZeRO 1/2: slices of one flat buffer
        for i, params in enumerate(zero_optimizer.bit16_groups):
            flat, part = zero_optimizer.bit16_groups_flat[i], zero_optimizer.single_partition_of_fp32_groups[i]
            rank = dist.get_rank(group=zero_optimizer.real_dp_process_group[i])
            low = rank * int(zero_optimizer.partition_size[i])  # DeepSpeed 0.16 keeps a float
            segments = []
            for p in params:
                offset = (p.data_ptr() - flat.data_ptr()) // p.element_size()
                start, end = max(offset, low), min(offset + p.numel(), low + part.numel())
                if start < end:
                    segments.append((p, start - offset, start - low, end - start))
            out.append((part, segments))
    elif hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):  # ZeRO 3: one shard of every parameter
        rank = dist.get_rank(group=zero_optimizer.dp_process_group)
        for params, part in zip(zero_optimizer.fp16_groups, zero_optimizer.fp32_partitioned_groups_flat):
            segments, position = [], 0
            for p in params:
                shard = p.ds_tensor.numel()
                length = max(0, min(p.ds_numel - rank * shard, shard))  # the rest is padding
                if length:
                    segments.append((p, rank * shard, position, length))
                position += shard
            out.append((part, segments))
    return out


def _elementwise_keys(client: Any, param: torch.Tensor) -> set[str] | None:
    """The state keys of `param` stored element by element like it (for an `optim.AdamW`), or None."""
    inner = getattr(client, "optimizer", client)  # through the strategy's wrapper
    composition = getattr(inner, "composition", None)
    options = getattr(inner, "_options_of", None)
    if composition is None or options is None:
        return None
    chosen = composition(param, options(param))
    flags = (*chosen.m.like_param, *chosen.v.like_param, *chosen.rule.like_param)
    return {key for key, like_param in zip(chosen.keys(), flags) if like_param}


@torch.no_grad()
def move_state_to_partitions(zero_optimizer: Any) -> int:
    """Move optimizer state made before DeepSpeed partitioned the parameters onto the partitions.

    A strategy may start state at construction (e.g. Collage's δθ seeded with the FP32 → BF16
    residual); DeepSpeed then replaces the optimizer's parameters by its flat partitions and that
    state would be stranded. Each state tensor of a parameter is copied into the matching slice of
    the partition's state (zeros elsewhere, as a fresh state starts). Call it after
    `deepspeed.initialize` and before the first step (the Trainer and `hf_lowprec.PrecisionPlugin` do).
    Returns the number of parameters whose state moved.
    """
    client = getattr(zero_optimizer, "optimizer", None)
    if client is None or not hasattr(client, "state"):
        return 0
    state = client.state
    current = {id(p) for g in client.param_groups for p in g["params"]}
    stale = {id(p) for p in state if isinstance(p, torch.Tensor) and id(p) not in current}
    if not stale:
        return 0
    moved = set()
    for part, segments in partition_segments(zero_optimizer):
        merged: dict[str, Any] = {}
        for param, p_start, q_start, length in segments:
            if id(param) not in stale:
                continue
            moved.add(id(param))
            elementwise = _elementwise_keys(client, param)
            for key, value in state[param].items():
                if elementwise is not None and torch.is_tensor(value) and value.dim() > 0 and key not in elementwise:
                    # Blocked or grouped storage (8-bit blocks and their absmax, COAT groups), even
                    # of a parameter with a single block, does not follow the parameter's elements:
                    # the partition's own is made fresh at its first step.
                    continue
                if torch.is_tensor(value) and value.numel() > 1:
                    buffer = merged.setdefault(key, torch.zeros(part.numel(), dtype=value.dtype, device=part.device))
                    buffer[q_start : q_start + length] = value.reshape(-1)[p_start : p_start + length]
                else:
                    merged.setdefault(key, value)
        if merged:
            state[part] = {
                k: v.view(part.shape) if torch.is_tensor(v) and v.numel() > 1 else v for k, v in merged.items()
            }
    # A parameter DeepSpeed partitioned has its state on the partitions now (on this rank or
    # another); state of tensors outside DeepSpeed's groups (fp8-lm-o3's FP8 weights) stays.
    groups = getattr(zero_optimizer, "bit16_groups", None) or getattr(zero_optimizer, "fp16_groups", [])
    partitioned = {id(p) for params in groups for p in params}
    for param in [p for p in state if isinstance(p, torch.Tensor) and id(p) in stale & partitioned]:
        del state[param]
    return len(moved)


def attach_zero_optimizer(zero_optimizer: Any) -> int:
    """Call after `deepspeed.initialize`, before the first step (the Trainer and `hf_lowprec.PrecisionPlugin` do).

    Moves state made before DeepSpeed partitioned the parameters onto the partitions
    (`move_state_to_partitions`), tells the strategy DeepSpeed's data-parallel group (a step is
    skipped on every rank together) and counts the steps DeepSpeed skips itself on it
    (`engines.zero_skips.count_deepspeed_skips`), then hands DeepSpeed's ZeRO optimizer to a client optimizer
    that works with it (`attach_zero`): fp8-lm-o3's `optim.zero_fp8.FP8ZeroAdamW` reads DeepSpeed's gradient
    norm and `gradient_clipping` from it, to clip the FP8 weights' gradients with the others,
    and learns the groups DeepSpeed steps one at a time. Returns the number of parameters
    whose state moved.
    """
    from ..memory import unwrap_optimizer

    moved = move_state_to_partitions(zero_optimizer)
    wrapper = getattr(zero_optimizer, "optimizer", None)
    strategy = getattr(wrapper, "strategy", None)
    if strategy is not None:
        # Each rank checks only its partition of the gradients: a non-finite value reduced into
        # one rank's partition must skip the step on every rank (DeepSpeed skips by itself only
        # where its gradient norm sees it: FP32 partitions, and only with the norm computed).
        strategy.set_data_parallel_group(getattr(zero_optimizer, "dp_process_group", None))
        # A step DeepSpeed skips itself never reaches the client optimizer: counted all the same.
        device = next((p.device for g in wrapper.param_groups for p in g["params"]), None)
        count_deepspeed_skips(zero_optimizer, strategy, device)
    client = unwrap_optimizer(wrapper)
    attach = getattr(client, "attach_zero", None)
    if callable(attach):
        attach(zero_optimizer)
    return moved
