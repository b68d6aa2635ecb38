"""A model's forward under a strategy as the stock mixed-precision flags give it: `widen_outputs`,
FP32 outputs (Accelerate's `convert_outputs_to_fp32` under `bf16=True`/`fp16=True`, flags a strategy
turns off), so a loss the trainer computes from them (label smoothing, `compute_loss_func`, TRL's
log-probabilities) and the predictions for `compute_metrics` are FP32; a model's own loss is unchanged.
`in_forward_context` wraps the forward in the strategy's autocast as Accelerate does, so a
`generate()` after training computes as the training forward did; `narrow_inputs` hands a
16-bit-weight strategy's forward (and an encoder-decoder's encoder) its float inputs in the weights' dtype.
"""

from __future__ import annotations

import functools
from types import MethodType
from typing import Any

import torch
from accelerate.utils import convert_to_fp32

from ..strategies.inputs import cast_float_inputs, computes_without_autocast
from ..strategies.interface import PrecisionStrategy
from .autocasting import autocast_disabled
from .peft import prepare_model

__all__ = [
    "computes_in_16_bits",
    "in_forward_context",
    "narrow_inputs",
    "owned_wrappers",
    "prepared_model",
    "release_wrappers",
    "widen_outputs",
]

_WRAPPERS = "_hf_lowprec_wrappers"


class _Wrappers:
    """What one strategy installed on a model (its `__dict__`): hook handles, the forward wrapper, and
    which of `forward`/`narrow`/`widen`/`context` are installed, so that each is installed once."""

    def __init__(self, strategy: Any) -> None:
        self.strategy, self.handles, self.kinds = strategy, [], set()
        self.forward: Any = None

    def __deepcopy__(self, memo: dict) -> None:  # a copy's hooks are its own (`copy.deepcopy` copies them)
        return None

    def __reduce__(self) -> tuple:
        return (type(None), ())


def release_wrappers(model: Any) -> None:
    """Remove from `model` the forward wrapper and hooks a strategy installed (`in_forward_context`,
    `narrow_inputs`, `widen_outputs`, the Accelerate plugin's context hooks): its forward is the stock
    one again. Called before another strategy installs its own."""
    if not isinstance(model, torch.nn.Module):
        return
    record = model.__dict__.pop(_WRAPPERS, None)
    if record is None:
        return
    for handle in record.handles:
        handle.remove()
    if record.forward is not None and model.__dict__.get("forward") is record.forward:
        original = model.__dict__.pop("_original_forward", None)
        del model.__dict__["forward"]
        if original is not None and getattr(original, "__func__", None) is not getattr(type(model), "forward", None):
            model.forward = original  # an instance forward set before the strategy's: kept


def owned_wrappers(strategy: Any, model: torch.nn.Module) -> _Wrappers:
    """The record of what `strategy` installed on `model`; a model another strategy object holds
    wrappers on has them removed first (`release_wrappers`)."""
    record = model.__dict__.get(_WRAPPERS)
    if record is None or record.strategy is not strategy:
        release_wrappers(model)
        record = model.__dict__[_WRAPPERS] = _Wrappers(strategy)
    return record


def computes_in_16_bits(strategy: PrecisionStrategy) -> bool:
    """Whether `strategy` computes in BF16 or FP16, under autocast (bf16-mixed, fp16-mixed, the FP8
    strategies, COAT) or in 16-bit weights (Collage, bf16-pure, fp16-als, …): the strategies standing
    in for `bf16=True`/`fp16=True`, whose model outputs the stock flags hand on in FP32."""
    return strategy.compute_dtype in (torch.bfloat16, torch.float16)


def _fp32_outputs(module: torch.nn.Module, args: Any, output: Any) -> Any:
    return convert_to_fp32(output)  # 16-bit float tensors, nested in tuples, lists, dicts and ModelOutputs


def widen_outputs(strategy: PrecisionStrategy | None, model: Any) -> Any:
    """`model`, its 16-bit outputs made FP32 after each forward where `strategy` computes in 16 bits
    (once per model and strategy; a module only: a name or a function is returned as it is)."""
    if strategy is None or not isinstance(model, torch.nn.Module):
        return model
    record = owned_wrappers(strategy, model)
    if computes_in_16_bits(strategy) and "widen" not in record.kinds:
        record.kinds.add("widen")
        record.handles.append(model.register_forward_hook(_fp32_outputs))
    return model


def _encoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The encoder an encoder-decoder model's `generate()` calls itself (`model.get_encoder()`,
    bypassing the model's forward), where it is a module of its own; else None."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False) or not callable(getattr(model, "get_encoder", None)):
        return None
    encoder = model.get_encoder()
    return encoder if isinstance(encoder, torch.nn.Module) and encoder is not model else None


def narrow_inputs(strategy: PrecisionStrategy | None, model: Any) -> Any:
    """`model`, its float inputs but the loss's (`labels`, `num_items_in_batch`) cast to the weights'
    dtype before each forward where `strategy` computes in 16-bit weights with no autocast
    (`strategies.inputs`; once per model and strategy). At the forward, not in the batch: what a trainer keeps
    beside the model's inputs (DPO's reference log-probabilities, GRPO's advantages) stays FP32. An
    encoder-decoder model's encoder casts too: `generate()` hands it the FP32 `input_features`
    (Whisper) or `input_values` directly."""
    if strategy is None or not isinstance(model, torch.nn.Module):
        return model
    record = owned_wrappers(strategy, model)
    if not computes_without_autocast(strategy) or "narrow" in record.kinds:
        return model
    record.kinds.add("narrow")

    @torch.compiler.disable  # Python, not traced
    def cast(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return cast_float_inputs(strategy, (args, kwargs))

    def cast_called_alone(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        # Compiled, the encoder runs inside the model's forward, whose hook has cast its inputs:
        # a call to `cast` there would break the graph in two.
        return None if torch.compiler.is_compiling() else cast(module, args, kwargs)

    for module, hook in ((model, cast), (_encoder(model), cast_called_alone)):
        if module is not None:
            record.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return model


def _autocasts(strategy: PrecisionStrategy) -> list[tuple[str, torch.dtype]]:
    """The (device, dtype) autocasts `strategy.forward_context()` turns on: none for a strategy
    whose context is none (its weights are the compute dtype)."""
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    with autocast_disabled(), strategy.forward_context():
        return [(d, torch.get_autocast_dtype(d)) for d in devices if torch.is_autocast_enabled(d)]


def in_forward_context(strategy: PrecisionStrategy, model: Any) -> Any:
    """`model` with its forward run under the strategy's autocast wherever it is called (a
    `generate()` after training, a pipeline), as `Accelerator.prepare` patches the forward under
    `bf16=True`; `_original_forward` keeps the stock one (`unwrap_model(keep_fp32_wrapper=False)`
    restores it). Plain `with torch.autocast` blocks, which torch.compile traces into the graph."""
    if not isinstance(model, torch.nn.Module):
        return model
    record = owned_wrappers(strategy, model)  # an earlier strategy's wrapper removed
    autocasts = _autocasts(strategy)
    if not autocasts or "forward" in record.kinds or "_original_forward" in model.__dict__:
        return model
    func = getattr(model.forward, "__func__", None)
    if func is None:  # already an instance attribute that is not a method: leave it
        return model
    (device, dtype), *more = autocasts

    @functools.wraps(func)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device, dtype=dtype):
            if more:  # CUDA beside CPU
                with torch.autocast(device_type=more[0][0], dtype=more[0][1]):
                    return func(self, *args, **kwargs)
            return func(self, *args, **kwargs)

    model._original_forward = model.forward
    model.forward = record.forward = MethodType(forward, model)
    record.kinds.add("forward")
    return model


def prepared_model(strategy: PrecisionStrategy, model: torch.nn.Module) -> torch.nn.Module:
    """The Trainer's model: `prepare_model`, its forward under the strategy's autocast, its float inputs
    in 16-bit weights' dtype, FP32 outputs."""
    model = in_forward_context(strategy, prepare_model(strategy, model))
    return widen_outputs(strategy, narrow_inputs(strategy, model))
