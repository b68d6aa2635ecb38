"""Published FP8 checkpoints (E4M3 + per-block scales) in and out (docs/checkpoints.md).

In: `restore_published_fp8` makes each published layer of a loaded model from the values the
checkpoint stores. Out: `write_published_fp8` rewrites a saved model's published layers into the
same format, so a model fine-tuned here loads in plain transformers and serves where the original did.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Any

import torch
from torch import nn

from ..fp8.blocks import BLOCK, FrozenBlockFP8Linear, dequantize_published, quantize_published
from .published_experts import holds_fp8_experts, restore_experts

__all__ = ["PUBLISHED_ATTR", "published_fp8_config", "release_quantized_fp8", "restore_published_fp8"]
__all__ += ["release_for_training", "write_published_fp8"]

logger = logging.getLogger(__name__)

# On the model: what was restored ({"layers": {name: kind}, ...}), for the startup report and the FP8 save.
PUBLISHED_ATTR = "hf_lowprec_fp8_published"

_QUANT_METHOD = "fp8"
_SCALE = ".weight_scale_inv"
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _is_peft(model: nn.Module) -> bool:
    return callable(getattr(model, "get_base_model", None))  # a peft.PeftModel (peft not imported here)


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if _is_peft(model) else model


def _source_dir(model: nn.Module) -> pathlib.Path | None:
    """The checkpoint folder `model` was loaded from: a local path, or the Hub cache's snapshot."""
    name = str(getattr(model, "name_or_path", "") or "")
    if not name:
        return None
    if os.path.isdir(name):
        return pathlib.Path(name)
    try:
        from huggingface_hub import snapshot_download

        return pathlib.Path(snapshot_download(name, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
    except Exception:  # not a Hub id, or not in the cache: nothing to read back
        return None


def _warn_source_not_found(model: nn.Module) -> None:
    """Once per model: a CPU load dequantizes a published FP8 checkpoint and drops its
    `quantization_config`, so only the folder tells; one that cannot be found is said, not skipped."""
    name = str(getattr(model, "name_or_path", "") or "")
    # A model built from a config has a config that names no source, whatever name it was given
    # (for a trainer's logs): no folder to find. Said once, by the first rank.
    loaded = bool(getattr(getattr(model, "config", None), "name_or_path", ""))
    if not (name and loaded) or model.__dict__.get("_fp8_source_warned") or os.environ.get("RANK", "0") != "0":
        return
    model.__dict__["_fp8_source_warned"] = True
    logger.warning(
        "the model was loaded from %r, which names neither a folder from here (current directory %s) nor "
        "a Hub cache entry: if it is a published FP8 checkpoint, its layers are not restored from the "
        "stored FP8 values (training starts from the dequantized ones) and save_model writes them in "
        "the model's dtype, not FP8. Load it from an absolute path that still exists at Trainer time.",
        name,
        os.getcwd(),
    )


def _fp8_config(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    found = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    method = str(found.get("quant_method", "")).lower().rsplit(".", 1)[-1]  # a QuantizationMethod or its value
    return found if method == _QUANT_METHOD else None


def published_fp8_config(model: nn.Module) -> dict[str, Any] | None:
    """The `quantization_config` of the fine-grained FP8 checkpoint `model` was loaded from, or None."""
    base = _base(model)
    found = _fp8_config(getattr(getattr(base, "config", None), "quantization_config", None))
    if found is not None:
        return found
    source = _source_dir(base)
    if source is None:
        _warn_source_not_found(base)
    if source is None or not (source / "config.json").is_file():
        return None
    return _fp8_config(json.loads((source / "config.json").read_text()).get("quantization_config"))


class _StoredTensors:
    """The checkpoint's tensors by name, read one at a time from its safetensors files."""

    def __init__(self, source: pathlib.Path | None) -> None:
        self.files: dict[str, pathlib.Path] = {}
        if source is None:
            return
        from safetensors import safe_open

        if (source / _INDEX).is_file():
            weight_map = json.loads((source / _INDEX).read_text())["weight_map"]
            self.files = {key: source / file for key, file in weight_map.items()}
        elif (source / _SINGLE).is_file():
            with safe_open(str(source / _SINGLE), "pt") as f:
                self.files = dict.fromkeys(f.keys(), source / _SINGLE)

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[key]), "pt") as f:
            return f.get_tensor(key)


def _grid(payload: torch.Tensor, scale: torch.Tensor, block: Any) -> tuple[torch.Tensor, tuple[int, int]]:
    """(scale, block) of one layer as `dequantize_published` takes them: the checkpoint's blocks,
    or, where its `weight_block_size` is null (one scale per tensor), the whole weight as one block."""
    if block is None:
        return scale.reshape(1, 1), (int(payload.shape[0]), int(payload.shape[1]))
    return scale, tuple(block)


def _is_transformers_fp8(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor) and weight.dtype == torch.float8_e4m3fn and hasattr(module, "weight_scale_inv")
    )


def _set_child(root: nn.Module, fqn: str, module: nn.Module) -> None:
    parent, _, child = fqn.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def _forget_quantization(base: nn.Module) -> None:
    """Drop transformers' quantized-model marks: the model is an ordinary one to train now. That
    includes the load's weight conversions where they dequantize: transformers 5.17 keeps them on
    the model and reverses them at every save, which quantized each `weight` (the embedding and the
    head too) and failed on the experts. Without them a save takes the model's default conversions
    (the experts split into the release's layout), as later releases do."""
    conversions = getattr(base, "_weight_conversions", None) or ()
    if any("quantize" in type(op).__name__.lower() for c in conversions for op in getattr(c, "operations", ())):
        base._weight_conversions = None
    quantizer = getattr(base, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(base)
    elif hasattr(getattr(base, "config", None), "quantization_config"):
        del base.config.quantization_config
    if getattr(base, "is_quantized", False):
        base.is_quantized = False


def _block_size(config: dict[str, Any], base: nn.Module) -> tuple[int, int] | None:
    """The checkpoint's `weight_block_size`, or None for one scale per tensor (null), which its
    linear layers take (FP8 experts with one scale per tensor are refused: not supported yet)."""
    block = config.get("weight_block_size")
    if block is None and any(holds_fp8_experts(m) for m in base.modules()):
        raise ValueError(
            "this FP8 checkpoint scales its experts per tensor (weight_block_size null), which hf_lowprec does not "
            "train yet; load it dequantized (quantization_config=FineGrainedFP8Config(dequantize=True)) and train BF16"
        )
    return None if block is None else tuple(block)


def release_quantized_fp8(model: nn.Module) -> int:
    """Swap transformers' FP8 inference layers for `FrozenBlockFP8Linear` carriers (the same bytes)
    and drop the quantized-model marks, so the Trainer accepts the model; `restore_published_fp8`
    then makes each layer what the strategy trains. Returns the number of layers swapped."""
    base = _base(model)
    config = published_fp8_config(base)
    if config is None:
        return 0
    block = _block_size(config, base)
    swapped = 0
    for fqn, module in list(base.named_modules()):
        if not _is_transformers_fp8(module):
            continue
        scale, grid = _grid(module.weight, module.weight_scale_inv, block)
        carrier = FrozenBlockFP8Linear(module.weight, scale, module.bias, block=grid)
        carrier.trainable = module.weight.requires_grad
        _set_child(base, fqn, carrier)
        swapped += 1
    # FP8 experts (transformers' inference module) are released at preparation (`published_experts.restore_experts`);
    # a release whose only FP8 weights are its experts drops the quantized-model marks here too.
    swapped += sum(1 for m in base.modules() if holds_fp8_experts(m))
    if swapped:
        base.__dict__["_fp8_published_config"] = config
        _forget_quantization(base)
    return swapped


def release_for_training(call: dict[str, Any]) -> None:
    """`release_quantized_fp8` of the model in a Trainer's arguments (bound by name), under a strategy."""
    model, args = call.get("model"), call.get("args")
    if getattr(args, "precision_strategy", None) is not None and isinstance(model, nn.Module):
        release_quantized_fp8(model)


def _published_dtype(base: nn.Module, source: pathlib.Path | None) -> torch.dtype:
    """The dtype the checkpoint stores outside its FP8 layers (its config's), else the model's."""
    dtype = getattr(getattr(base, "config", None), "dtype", None)
    if source is not None and (source / "config.json").is_file():
        stored = json.loads((source / "config.json").read_text())
        dtype = stored.get("dtype", stored.get("torch_dtype", dtype))
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16


def _linear(
    payload: torch.Tensor, scale: torch.Tensor, bias: Any, block: Any, dtype: torch.dtype, grad: bool
) -> nn.Linear:
    out_features, in_features = payload.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(dequantize_published(payload, scale, dtype, block), requires_grad=grad)
    if bias is not None:
        layer.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias)
    return layer


def restore_published_fp8(model: nn.Module, *, keep_frozen_fp8: bool) -> dict[str, Any] | None:
    """Make each published FP8 layer of `model` from its stored values; returns the record kept on
    the model ({"layers": {name: "trained" | "frozen FP8" | "frozen"}, ...}), or None for a model
    not loaded from an FP8 checkpoint. Idempotent.

    `from_pretrained` gives either transformers' own FP8Linear inference layers (E4M3 payloads and
    `weight_scale_inv`; a machine with FP8 GEMMs) or ordinary layers dequantized into the model's
    dtype (a CPU: the FP32 values rounded once more). The stored values come from the layers or,
    after a dequantized load, from the checkpoint's files (each layer checked against its loaded
    weight first: a layer changed since loading keeps its values). Each published layer becomes

    - trained: an `nn.Linear` holding payload · scale in FP32 (exact: the values the checkpoint
      means); the strategy makes its masters from them, one rounding, not two;
    - frozen (a LoRA base), where `keep_frozen_fp8`: a `FrozenBlockFP8Linear` holding payload and
      scales as published, 1 byte per parameter;
    - frozen otherwise: an `nn.Linear` in the loaded dtype, as transformers dequantizes it.
    """
    base = _base(model)
    if PUBLISHED_ATTR in base.__dict__:
        return base.__dict__[PUBLISHED_ATTR]
    config = base.__dict__.get("_fp8_published_config") or published_fp8_config(base)
    if config is None:
        return None
    block = _block_size(config, base)
    stored: _StoredTensors | None = None
    layers: dict[str, str] = {}
    changed: list[str] = []
    source = _source_dir(base)
    loaded_dtype = _published_dtype(base, source)
    for fqn, module in list(base.named_modules()):
        name = fqn.replace(".base_layer", "")  # a PEFT layer wraps the checkpoint's layer
        if isinstance(module, FrozenBlockFP8Linear):
            payload, scale, trainable = module.weight, module.weight_scale_inv, getattr(module, "trainable", False)
        elif _is_transformers_fp8(module):
            payload, scale, trainable = module.weight, module.weight_scale_inv, module.weight.requires_grad
        elif type(module) is nn.Linear:
            stored = stored if stored is not None else _StoredTensors(source)
            if name + _SCALE not in stored or name + ".weight" not in stored:
                continue
            payload, scale = stored.get(name + ".weight"), stored.get(name + _SCALE)
            weight = module.weight
            grid_scale, grid = _grid(payload, scale, block)
            as_loaded = dequantize_published(payload, grid_scale, weight.dtype, grid).to(weight.device)
            if not torch.equal(as_loaded, weight.detach()):  # once, at preparation
                changed.append(name)
                continue
            trainable = weight.requires_grad
        else:
            continue
        payload, (scale, grid) = payload.detach(), _grid(payload, scale.detach(), block)
        if trainable:
            layers[name] = "trained from FP32 values"
            if type(module) is nn.Linear:  # in place: the parameter others hold stays the same object
                module.weight.data = dequantize_published(payload, scale, torch.float32, grid)
                continue
            new: nn.Module = _linear(payload, scale, module.bias, grid, torch.float32, True)
        elif keep_frozen_fp8:
            new = (
                module
                if isinstance(module, FrozenBlockFP8Linear)
                else FrozenBlockFP8Linear(payload, scale, module.bias, block=grid)
            )
            layers[name] = "frozen as published FP8"
        else:
            new = (
                module if type(module) is nn.Linear else _linear(payload, scale, module.bias, grid, loaded_dtype, False)
            )
            layers[name] = "frozen, dequantized"
        if new is not module:
            new.train(module.training)
            _set_child(base, fqn, new)
    stored = stored if stored is not None else _StoredTensors(source)
    restore_experts(base, stored, block or BLOCK, layers, changed, _published_dtype(base, None))
    if changed:
        logger.warning(
            "FP8 checkpoint: %d layers differ from the checkpoint's stored values (changed after loading?) and "
            "keep their values: %s",
            len(changed),
            ", ".join(changed[:5]) + (" …" if len(changed) > 5 else ""),
        )
    _forget_quantization(base)
    _not_broadcast_by_ddp(model)
    record = {
        "quantization_config": config,
        "block": block,
        "layers": layers,
        "changed": changed,
        "source": source,
        "dtype": loaded_dtype,  # of what the checkpoint holds outside its FP8 layers
    }
    base.__dict__[PUBLISHED_ATTR] = model.__dict__[PUBLISHED_ATTR] = record  # read by the startup report
    logger.info("FP8 checkpoint: %d published layers restored from their stored values", len(layers))
    return record


def _not_broadcast_by_ddp(model: nn.Module) -> None:
    """DDP broadcasts every parameter from rank 0 when it wraps the model; a frozen published layer
    is the same bytes on every rank (each loaded the checkpoint) and gloo cannot send FP8: skip it."""
    frozen = [
        f"{fqn}.{name}".lstrip(".")
        for fqn, module in model.named_modules()
        if isinstance(module, FrozenBlockFP8Linear)
        for name, p in module.named_parameters(recurse=False)
        if not p.requires_grad
    ]
    if frozen:
        ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, sorted(ignored | set(frozen))
        )


def write_published_fp8(output_dir: str | os.PathLike, model: nn.Module) -> int:
    """Rewrite the published layers of the model saved in `output_dir` into the checkpoint's FP8
    format (E4M3 payload, `weight_scale_inv` per block, the checkpoint's `quantization_config`; a
    frozen layer is written as it was read, bit for bit); returns the number of layers written, 0 where `model` was not
    loaded from an FP8 checkpoint or is a PEFT model (whose save holds its adapters only)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    base = _base(model)
    record = base.__dict__.get(PUBLISHED_ATTR)
    if record is None or _is_peft(model) or not record["layers"]:
        return 0
    folder = pathlib.Path(output_dir)
    index_path = folder / _INDEX
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    files = sorted(set(index["weight_map"].values())) if index else [_SINGLE]
    block, scale_fmt = record["block"], record["quantization_config"].get("scale_fmt", "float")
    stored = _StoredTensors(record["source"])
    fp8_weights = {name + suffix for name in record["layers"] for suffix in (".weight", _SCALE)}
    dtype = record["dtype"]
    written = total = 0
    for file in files:
        with safe_open(str(folder / file), "pt") as f:
            names = f.keys()
            tensors = {key: f.get_tensor(key) for key in names}
            metadata = f.metadata()
        # Outside the FP8 layers, the published dtype (a strategy's export may be FP32 masters).
        other = [
            k
            for k, t in tensors.items()
            if k not in fp8_weights and t.is_floating_point() and t.dtype.itemsize > 1 and t.dtype != dtype
        ]
        rewrite = bool(other)
        tensors.update({key: tensors[key].to(dtype) for key in other})
        for name, kind in record["layers"].items():
            key = name + ".weight"
            if key not in tensors or tensors[key].dtype == torch.float8_e4m3fn:  # a frozen FP8 layer: as read
                continue
            if kind == "frozen, dequantized" and name + _SCALE in stored:  # never trained: the published bytes
                tensors[key], tensors[name + _SCALE] = stored.get(key), stored.get(name + _SCALE)
            elif block is None:  # one scale per tensor, stored in the checkpoint's shape
                shape = stored.get(name + _SCALE).shape if name + _SCALE in stored else (1,)
                payload, scale = quantize_published(tensors[key], tuple(tensors[key].shape), scale_fmt=scale_fmt)
                tensors[key], tensors[name + _SCALE] = payload, scale.reshape(shape)
            else:
                tensors[key], tensors[name + _SCALE] = quantize_published(tensors[key], block, scale_fmt=scale_fmt)
            if index:
                index["weight_map"][name + _SCALE] = file
            rewrite, written = True, written + 1
        if rewrite:
            save_file(tensors, str(folder / file), metadata=metadata or {"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if index:
        index.setdefault("metadata", {})["total_size"] = total  # the FP8 bytes, not the export's
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = record["quantization_config"]
    config["dtype"] = str(record["dtype"]).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return written
