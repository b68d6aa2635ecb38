"""The models the planners read, offline: a named shape (`MODELS`) or a transformers
`config.json`, checked (`model_config`) and built without weights (`build_model`), and the
model-state memory of each strategy on it (`memory_plan`: what `hf-lowprec memory` prints and
`hf-lowprec plan` reuses, one source for both; a deep model whose blocks are alike is planned at
one and two blocks and scaled, exactly). `blocks_of` finds a model's decoder blocks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..strategies.registry import available_strategies, get_strategy
from .heads import check_text_only

__all__ = [
    "MODELS",
    "block_kinds",
    "blocks_of",
    "build_model",
    "engine_refusal",
    "layer_overrides",
    "memory_plan",
    "model_config",
    "position_limit",
    "quiet",
    "rule_options",
    "uniform_depth",
]


@contextlib.contextmanager
def quiet(*names: str) -> Iterator[None]:
    """Within the scope, the loggers `names` (default: the package's and transformers') say
    errors only; their levels are restored after (a plan's start-up warnings, once per strategy
    and depth, would bury its table)."""
    loggers = [logging.getLogger(name) for name in names or ("hf_lowprec", "transformers")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# Named model shapes for `memory`: (config class, its arguments, model class), all from transformers.
MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    "gpt2": ("GPT2Config", {}, "GPT2LMHeadModel"),
    "bert-base": ("BertConfig", {}, "BertForMaskedLM"),
    "roberta-base": (
        "RobertaConfig",
        {"vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1, "pad_token_id": 1},
        "RobertaForMaskedLM",
    ),
    "llama-7b": (
        "LlamaConfig",
        {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
        },
        "LlamaForCausalLM",
    ),
    # The device check's end-to-end model (docs/gpu.md): Llama-style, 0.63 B parameters.
    "llama-0.63b": (
        "LlamaConfig",
        {
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "use_cache": False,
        },
        "LlamaForCausalLM",
    ),
    # The device check's MoE model: Qwen3-MoE-shaped, 0.90 B (64 experts of width 512, top-4).
    "qwen3-moe-0.9b": (
        "Qwen3MoeConfig",
        {
            "vocab_size": 32000,
            "hidden_size": 1024,
            "intermediate_size": 1024,
            "moe_intermediate_size": 512,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_experts": 64,
            "num_experts_per_tok": 4,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
            "use_cache": False,
        },
        "Qwen3MoeForCausalLM",
    ),
    # Llama-3-70B's published shape.
    "llama-3-70b": (
        "LlamaConfig",
        {
            "vocab_size": 128256,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "use_cache": False,
        },
        "LlamaForCausalLM",
    ),
    # A Mixture-of-Experts model: 128 experts, top-8, expert width 768 (its published config).
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "tie_word_embeddings": False,
        },
        "Qwen3MoeForCausalLM",
    ),
}


# Config fields that count or size something: a model needs each at least 1.
_SIZE_FIELDS = (
    "vocab_size",
    "n_layer",
    "n_head",
    "n_embd",
    "n_positions",
    "n_inner",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "max_position_embeddings",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
)
# Sizes that may also be given per layer (a list): checked where a config gives one number.
# A `head_dim` of 0 beside a `qk_head_dim` is legal (multi-head latent attention sizes its heads so).
_SIZE_IF_NUMBER = ("head_dim", "moe_intermediate_size")


def model_config(model: str) -> tuple[Any, Any]:
    """The config (a copy of its own: callers may change it) and model class `--model` names (a
    known shape or a config.json), checked; ValueError if bad."""
    config, cls = _checked_config(model)
    return copy.deepcopy(config), cls


@functools.cache
def _checked_config(model: str) -> tuple[Any, Any]:
    """The config and model class `--model` names (a known shape or a config.json), checked; ValueError if bad."""
    import transformers

    if model in MODELS:
        config_cls, kwargs, model_cls = MODELS[model]
        return getattr(transformers, config_cls)(**kwargs), getattr(transformers, model_cls)
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"  # a model directory, as from_pretrained takes it
    if not path.is_file():
        raise ValueError(f"--model must be one of {sorted(MODELS)} or a path to a config.json; {model!r} is neither")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except Exception as err:  # transformers' own checks raise its validation errors, not ValueError
        raise ValueError(f"--model {model}: not a valid transformers config.json ({_innermost(err)})") from None
    check_text_only(model, config)
    for key in (*_SIZE_FIELDS, *_SIZE_IF_NUMBER):
        value = _field(config, key)
        if key in _SIZE_IF_NUMBER and (
            isinstance(value, list) or (key == "head_dim" and _field(config, "qk_head_dim"))
        ):
            continue
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"--model {model}: {key} must be a positive integer, got {value!r}; fix it in the config")
    _check_shapes(model, config)
    arch = (getattr(config, "architectures", None) or [None])[0]
    if arch and hasattr(transformers, arch):
        cls = getattr(transformers, arch)
    elif type(config) in transformers.AutoModelForCausalLM._model_mapping:
        cls = transformers.AutoModelForCausalLM
    else:
        raise ValueError(
            f"--model {model}: model_type {config.model_type!r} has no causal-LM class and the config names "
            'no architecture; the planners count language models: add "architectures" (e.g. '
            '["BertForMaskedLM"]) to the config or pass a causal LM\'s config'
        )
    concrete = (
        transformers.AutoModelForCausalLM._model_mapping[type(config)]
        if cls is transformers.AutoModelForCausalLM
        else cls
    )
    if (
        getattr(config, "is_encoder_decoder", False)
        or "input_ids" not in inspect.signature(concrete.forward).parameters
    ):
        raise ValueError(
            f"--model {model}: {cls.__name__} is not a decoder-only or encoder-only language model (token "
            "ids in, one stack of blocks); the planners count those only"
        )
    return config, cls


def _innermost(err: BaseException) -> str:
    """The first line of the innermost cause's message (transformers wraps its own checks)."""
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _field(config: Any, key: str) -> Any:
    """`config.key`, or None where it lacks it or holds it per layer only (transformers raises then)."""
    try:
        return getattr(config, key, None)
    except RuntimeError:  # a per-layer attribute of a heterogeneous config
        return None


def _check_shapes(model: str, config: Any) -> None:
    """Head and expert counts that cannot build a model: ValueError naming the fields."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv = getattr(config, "num_key_value_heads", None)
    if heads and kv and heads % kv:
        raise ValueError(f"--model {model}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if heads and hidden and getattr(config, "head_dim", None) is None and hidden % heads:
        raise ValueError(f"--model {model}: hidden size {hidden} is not a multiple of {heads} attention heads")
    chosen = getattr(config, "num_experts_per_tok", None)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        experts = getattr(config, key, None)
        if isinstance(experts, int) and isinstance(chosen, int) and experts and chosen > experts:
            raise ValueError(f"--model {model}: num_experts_per_tok {chosen} is more than {key} {experts}")


def position_limit(model: str) -> int | None:
    """The most tokens a sequence of `model` can hold where its positions are a learned table
    (GPT-2, BERT, RoBERTa: a longer sequence cannot run); None for rotary and other positions."""
    config = model_config(model)[0]
    built = build_model(model, **layer_overrides(config, 1))
    for name, module in built.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in ("wpe", "position_embeddings"):
            pad = module.padding_idx  # RoBERTa counts positions from its padding index + 1
            return module.num_embeddings - (0 if pad is None else pad + 1)
    return None


def build_model(model: str, device: Any = "meta", **overrides: Any) -> torch.nn.Module:
    """The model `model` names (`model_config`), built on `device` ("meta": no weights), with
    `overrides` set on its config (e.g. fewer layers)."""
    import transformers

    config, cls = model_config(model)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device(device):
        return cls.from_config(config) if cls is transformers.AutoModelForCausalLM else cls(config)


def blocks_of(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder blocks: its longest `ModuleList` of modules of one class."""
    best: torch.nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best):
                best = module
    if best is None:
        raise ValueError(f"{type(model).__name__} has no list of decoder blocks to count")
    return best


def layer_overrides(config: Any, layers: int) -> dict[str, Any]:
    """Config fields that set the depth to `layers` (and a per-layer list cut to it)."""
    out: dict[str, Any] = {}
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(config, key):
            out[key] = layers
    if getattr(config, "layer_types", None):
        out["layer_types"] = list(config.layer_types)[:layers]
    return out


def rule_options(name: str, gpu: Any = None, tokens: int = 8192) -> dict[str, Any]:
    """The options that make strategy `name` keep in BF16 what FP8 would not speed up on `gpu`
    (a `hardware.GPU`) at `tokens` a micro-batch, as it does when it runs there; without a `gpu`
    (or one the table lacks), every layer converted; {} for a strategy without the rule."""
    from ..hardware import GPUS
    from ..strategies.registry import REGISTRY

    if name not in REGISTRY:
        return {}
    fields = {f.name for f in dataclasses.fields(REGISTRY[name][0].Options)}
    if "fp8_layers" not in fields:
        return {}
    if gpu is None:  # no GPU named: every layer, whatever GPU this process happens to have
        return {"fp8_layers": "all"}
    key = next((k for k, g in GPUS.items() if g.name == gpu.name), "")
    return {"fp8_gpu": key, "fp8_tokens": tokens} if key else {"fp8_layers": "all"}


def memory_plan(
    model: str, strategies: list[str], world_size: int = 1, zero_stage: int = 0, gpu: Any = None, tokens: int = 8192
) -> list[dict[str, Any]]:
    """Model-state memory per strategy for `model`, planned on the meta device (no weights allocated).

    Each strategy prepares the meta model and builds its optimizer; the optimizer's own state
    initialisers give the state tensors (`hf_lowprec.report.plan_model_state`). With ZeRO, the
    per-rank share follows `hf_lowprec.report.zero_per_rank`. With a `gpu`, FP8 strategies keep
    in BF16 what FP8 would not speed up there at `tokens` a micro-batch (`rule_options`), and
    FP8-LM O2's "extra" holds the E4M3 weight its step writes for the next forward (1 B per FP8
    GEMM weight, below ZeRO-3/FSDP2), which an eager layer on a GPU keeps; a CPU keeps none.
    A model deeper than two blocks, all alike, is planned at one and two blocks and scaled: the
    same figures, to the bit, as the whole model's (a strategy treats alike blocks alike).
    """
    from ..report import zero_per_rank

    depth = uniform_depth(model)
    rows = []
    for name in strategies:
        strategy_options = rule_options(name, gpu, tokens)
        held = gpu is not None and zero_stage < 3  # FSDP2's and ZeRO-3's sharded weights hold no FP8 copy
        if depth > 2:  # blocks alike: two shallow plans, scaled to the depth (exactly)
            (one, refusal), (two, _) = (_state_bytes(model, name, strategy_options, n, held) for n in (1, 2))
            totals = {k: one[k] + (depth - 1) * (two[k] - one[k]) for k in one}
        else:
            totals, refusal = _state_bytes(model, name, strategy_options, None, held)
        num_params = totals.pop("num_params")
        plan = {k: v / num_params for k, v in totals.items()}
        plan["total"] = sum(plan.values())
        plan["num_params"] = float(num_params)
        row = {"strategy": name, **plan, "refused": refusal}  # the first step's refusal (no FP8 layer), or None
        if world_size > 1 or zero_stage:
            refusal = engine_refusal(name, f"zero{zero_stage}" if zero_stage else "ddp")
            per_rank = zero_per_rank(plan, world_size, zero_stage)
            row["per_rank_total"] = per_rank["total"]
            row["zero"] = refusal or "ok"
        rows.append(row)
    return rows


def _state_bytes(
    model: str, name: str, options: dict[str, Any], layers: int | None, on_gpu: bool = False
) -> tuple[dict[str, int], str | None]:
    """Strategy `name`'s model state on `model` (at `layers` decoder layers, the config's unset),
    as whole bytes per component and the parameter count (`report.plan_model_state`'s figures
    times the count: every term is a whole number of bytes). `on_gpu`: "extra" also holds the FP8
    weight each layer keeps between steps when it runs eagerly on a GPU (FP8-LM O2's written
    weight, 1 B each: `FP8Linear.held_weight_bytes`; a CPU holds none). Beside them: the refusal
    the run would meet at its first step for want of an FP8 layer (`fp8.refusal`), or None."""
    from ..fp8 import FP8Linear
    from ..fp8.refusal import no_fp8_layer
    from ..report import plan_model_state

    overrides = {} if layers is None else layer_overrides(model_config(model)[0], layers)
    strategy = get_strategy(name, **options)
    with quiet("hf_lowprec.fp8", "hf_lowprec.strategies.fp8_rule"):  # skipped layers, the refusal: said below
        prepared = strategy.prepare_model(build_model(model, **overrides))
    refusal = no_fp8_layer(prepared, name, uses_fp8_gemm=strategy.uses_fp8_gemm, frozen_in_fp8=strategy.frozen_in_fp8)
    optimizer = strategy.create_optimizer([p for p in prepared.parameters() if p.requires_grad], lr=1e-4)
    plan = plan_model_state(prepared, optimizer)
    count = int(plan["num_params"])
    out = {k: round(plan[k] * count) for k in ("params", "grads", "optimizer_states", "extra")}
    if on_gpu:
        out["extra"] += sum(m.held_weight_bytes() for m in prepared.modules() if isinstance(m, FP8Linear))
    return {**out, "num_params": count}, refusal


def _signature(block: torch.nn.Module) -> tuple:
    """What makes two blocks alike: their parameters by name, shape and dtype, their submodules' classes."""
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    return params, tuple((n, type(m).__name__) for n, m in block.named_modules())


@functools.cache
def _kinds(model: str) -> dict[tuple, list[int]]:
    """{block signature: the indices of `model`'s decoder blocks that have it}, in block order."""
    kinds: dict[tuple, list[int]] = {}
    for index, block in enumerate(blocks_of(build_model(model))):
        kinds.setdefault(_signature(block), []).append(index)
    return kinds


def block_kinds(model: str) -> list[list[int]]:
    """The decoder blocks of `model` grouped by kind (alike blocks: `_signature`), each group the
    blocks' indices, in the order the kinds first appear: one group where every block is alike,
    [[0, 1, 2], [3, ..., 60]] for DeepSeek-V3's three dense blocks and 58 of experts."""
    return list(_kinds(model).values())


@functools.cache
def uniform_depth(model: str) -> int:
    """The number of decoder blocks of `model` when they are all alike (one kind, `_kinds`) and
    alike the blocks of the model built at one and two layers, so that each adds the same state
    whatever a strategy does to it; 0 when they differ (dense first layers, per-layer widths)."""
    try:
        kinds = _kinds(model)
        config = model_config(model)[0]
        shallow = [blocks_of(build_model(model, **layer_overrides(config, n))) for n in (1, 2)]
    except ValueError:
        return 0
    if len(kinds) != 1 or [len(blocks) for blocks in shallow] != [1, 2]:
        return 0
    ((signature, indices),) = kinds.items()
    return len(indices) if all(_signature(block) == signature for blocks in shallow for block in blocks) else 0


def engine_refusal(name: str, engine: str) -> str | None:
    """The support matrix's refusal for strategy `name` under `engine` ("ddp", "fsdp2", "zero1",
    "zero2", "zero3"), what the engine itself raises before training; None where it trains (and
    for the peer rows, which are torch's own recipes)."""
    from ..engines.ddp import ddp_support
    from ..engines.fsdp2 import fsdp2_support
    from ..engines.zero import zero_support  # imports without DeepSpeed

    if name not in available_strategies():
        return None
    strategy = get_strategy(name)
    if engine.startswith("zero"):
        return zero_support(strategy, int(engine[len("zero") :]))
    return {"ddp": ddp_support, "fsdp2": fsdp2_support}[engine](strategy)
