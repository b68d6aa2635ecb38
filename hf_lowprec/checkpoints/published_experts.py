"""FP8-published Mixture-of-Experts releases (docs/checkpoints.md): the fused experts made from the
per-expert stored values, and transformers' FP8 experts module released for training.
`checkpoints/fp8_published.py` calls these while it restores a release's layers; `stored` is its
reader of the checkpoint's tensors (`key in stored`, `stored.get(key)`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..fp8.blocks import dequantize_published
from ..fp8.experts import expert_weight_names, is_experts_module

__all__ = ["holds_fp8_experts", "restore_experts"]

_SCALE = ".weight_scale_inv"


def holds_fp8_experts(module: nn.Module) -> bool:
    """An experts module whose weights are E4M3 payloads (transformers' FP8 experts, a GPU load)."""
    return is_experts_module(module) and any(
        getattr(module, name).dtype == torch.float8_e4m3fn for name in expert_weight_names(module)
    )


# Per-expert projections as FP8 MoE releases store them, and the fused weight transformers builds.
_EXPERT_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}


def restore_experts(
    base: nn.Module, stored: Any, block: Any, layers: dict[str, str], changed: list[str], loaded_dtype: torch.dtype
) -> None:
    """The fused experts of an FP8 MoE release, made from their stored values: each 3-D weight is
    the per-expert stored weights (`experts.N.gate_proj.weight` with its `weight_scale_inv`,
    concatenated [gate; up] as transformers fuses them), in FP32 where it trains; a frozen one has
    the loaded values (dequantized). After a dequantized load (a CPU) they are read from the files,
    each fused weight checked against the loaded one first; after a load into transformers' FP8
    experts (a GPU) they are the module's own payload and block scales, released here so that the
    module computes in high precision (`_released_class`). Each per-expert
    projection is recorded as a layer, so the FP8 save writes it back in the release's layout."""
    for fqn, module in base.named_modules():
        if not is_experts_module(module) or module.is_transposed or not getattr(module, "is_concatenated", True):
            continue  # (gpt-oss's interleaved, transposed experts are published in MXFP4, not here)
        for param_name in expert_weight_names(module):
            weight = getattr(module, param_name)
            parts = _EXPERT_PROJECTIONS[param_name]
            names = [f"{fqn}.{e}.{part}" for e in range(weight.shape[0]) for part in parts]
            scale_inv = getattr(module, param_name + "_scale_inv", None)
            if weight.dtype == torch.float8_e4m3fn and isinstance(scale_inv, torch.Tensor):
                trainable = weight.requires_grad or not _is_peft_frozen(base)
                real = torch.stack(
                    [
                        dequantize_published(w, s, torch.float32, block)
                        for w, s in zip(weight.detach(), scale_inv.detach())
                    ]
                )
                del module._parameters[param_name + "_scale_inv"]
                module.register_buffer(param_name + "_scale_inv", scale_inv.detach(), persistent=False)
                value = real if trainable else real.to(loaded_dtype)
                setattr(module, param_name, nn.Parameter(value, requires_grad=trainable))
                module.__class__ = _released_class(type(module))
                layers.update(dict.fromkeys(names, "trained from FP32 values" if trainable else "frozen, dequantized"))
                continue
            if not all(n + ".weight" in stored and n + _SCALE in stored for n in names):
                continue
            values = [
                torch.cat([_stored_values(stored, f"{fqn}.{e}.{part}", block) for part in parts])
                for e in range(weight.shape[0])
            ]
            real = torch.stack(values).to(weight.device)
            if tuple(real.shape) != tuple(weight.shape) or not torch.equal(real.to(weight.dtype), weight.detach()):
                changed.append(f"{fqn}.{param_name}")
                continue
            if weight.requires_grad:
                weight.data = real  # in place: the parameter others hold stays the same object
                layers.update(dict.fromkeys(names, "trained from FP32 values"))
            else:
                layers.update(dict.fromkeys(names, "frozen, dequantized"))


_RELEASED: dict[type, type] = {}


def _released_class(cls: type) -> type:
    """transformers' FP8 experts class with the plain experts forward: its own dispatches to FP8
    kernels (the `grouped_mm` default), which a released module's high-precision weights cannot
    take. The implementation the config names runs (`ALL_EXPERTS_FUNCTIONS`), else the class's own
    eager loop, which multiplies any non-FP8 weight with `F.linear`."""
    if cls in _RELEASED.values():
        return cls
    if cls not in _RELEASED:
        eager = getattr(cls.forward, "__wrapped__", cls.forward)

        def forward(self: nn.Module, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

            name = getattr(getattr(self, "config", None), "_experts_implementation", None)
            if name is not None and name != "eager" and name in ALL_EXPERTS_FUNCTIONS:
                return ALL_EXPERTS_FUNCTIONS[name](self, hidden_states, top_k_index, top_k_weights)
            return eager(self, hidden_states, top_k_index, top_k_weights)

        _RELEASED[cls] = type(f"Released{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    return _RELEASED[cls]


def _is_peft_frozen(base: nn.Module) -> bool:
    """Whether a PEFT adapter froze the base (FP8 parameters cannot say: they never require grad)."""
    return any("lora_" in name for name, _ in base.named_parameters())


def _stored_values(stored: Any, name: str, block: Any) -> torch.Tensor:
    return dequantize_published(stored.get(name + ".weight"), stored.get(name + _SCALE), torch.float32, block)
