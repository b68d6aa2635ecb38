"""A trained model cast to a strategy's 16-bit dtype (`cast_model`): its parameters take the dtype
(on request but those transformers keeps in FP32), and so do its buffers but those transformers keeps
in FP32 when it loads a model in 16 bits, above all the rotary frequencies. `Module.to` would round
them too: a frequency f rounded to BF16 moves position p's angle by up to p·f·2⁻⁸ (2⁻¹¹ in FP16),
several radians at position 4,095 for the fast-rotating pairs, angles a pretrained checkpoint never
saw (docs/numerics.md, "Rotary frequencies").
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.utils.parametrizations

from ..memory import KEPT_FP32_ATTR, kept_in_fp32

__all__ = ["cast_model", "fp32_module_patterns", "kept_buffers", "kept_parameters", "narrow_kept_parameters"]


def fp32_module_patterns(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """The names transformers keeps in FP32 when it loads `model` in `dtype`: its
    `_keep_in_fp32_modules_strict`, and for FP16 its `_keep_in_fp32_modules` too (T5's `wo`, whose
    input overflows FP16); a parameter or buffer is kept when its qualified name contains one."""
    patterns = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return patterns


logger = logging.getLogger(__name__)

# torch names its orthogonal parametrization's class privately; without it, nothing to warn of.
_ORTHOGONAL = getattr(torch.nn.utils.parametrizations, "_Orthogonal", None)


def kept_buffers(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[torch.nn.Module, str]]:
    """(module, name) of each floating or complex buffer a cast to `dtype` leaves as it is: those of
    a rotary embedding (transformers names their classes `…RotaryEmbedding`; Llama 4's vision
    frequencies are complex), any buffer named `inv_freq`, and those the model's
    `_keep_in_fp32_modules_strict` names (`_keep_in_fp32_modules` too for FP16), as
    transformers' loading keeps them (DeepSeek-V3's `e_score_correction_bias`)."""
    patterns = fp32_module_patterns(model, dtype)
    kept = []
    for prefix, module in model.named_modules():
        rotary = "Rotary" in type(module).__name__
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or not (buffer.is_floating_point() or buffer.is_complex()):
                continue
            qualified = f"{prefix}.{name}" if prefix else name
            if rotary or name == "inv_freq" or any(pattern in qualified for pattern in patterns):
                kept.append((module, name))
    return kept


def kept_parameters(model: torch.nn.Module, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """The floating parameters `from_pretrained(dtype=dtype)` keeps in FP32, each (tied) one once: those
    `fp32_module_patterns` names (T5's `wo` in FP16, DeepSeek-V3's router `gate.weight`)."""
    patterns = fp32_module_patterns(model, dtype)
    if not patterns:
        return []
    named = model.named_parameters()
    return [p for name, p in named if p.is_floating_point() and any(pattern in name for pattern in patterns)]


def cast_model(model: torch.nn.Module, dtype: torch.dtype, *, keep_fp32_parameters: bool = False) -> torch.nn.Module:
    """`model.to(dtype)` but for `kept_buffers`, which keep their tensors (and dtype); in place,
    as `Module.to` is (the parameters stay the same objects). `keep_fp32_parameters`: the
    `kept_parameters` are made (or stay) FP32 instead, as transformers loads them, for a strategy
    whose optimizer steps FP32 parameters as plain FP32 AdamW. A parameter beyond FP16's range is
    refused before anything is cast to FP16: it would become inf, and every step be skipped."""
    wide = kept_parameters(model, dtype) if keep_fp32_parameters else []
    if dtype == torch.float16:
        _refuse_fp16_overflow(model, {id(p) for p in wide})
    _warn_orthogonal(model, dtype)
    kept = [(module, name, module._buffers[name]) for module, name in kept_buffers(model, dtype)]
    values = [p.detach().float() for p in wide]  # an FP32 parameter's own storage: no copy
    model = model.to(dtype)
    for module, name, buffer in kept:
        module._buffers[name] = buffer
    for param, value in zip(wide, values):
        param.data = value
        setattr(param, KEPT_FP32_ATTR, True)
    return model


def narrow_kept_parameters(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Cast the parameters `cast_model` kept FP32 to `dtype` (in place, the same objects) and return their
    names: before FSDP2's `fully_shard`, whose blocks all-gather parameters of one dtype."""
    kept = [(name, p) for name, p in model.named_parameters() if kept_in_fp32(p)]
    for _, param in kept:
        param.data = param.data.to(dtype)
    names = [name for name, _ in kept]
    if names:
        logger.warning(
            "FSDP2 shards a block's parameters in one dtype: %s, kept FP32 as transformers loads them, "
            "now train in %s (under DDP they stay FP32)",
            ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else ""),
            str(dtype).removeprefix("torch."),
        )
    return names


def _warn_orthogonal(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Warn of `nn.utils.parametrizations.orthogonal` tensors, which the cast computes in 16 bits: their
    maps are not made for it (a 32×16 matrix_exp weight in BF16 goes inf after one AdamW step, then
    NaN, and every step is skipped; Cayley has no BF16 `linalg.solve` on CPU)."""
    if _ORTHOGONAL is None:
        return
    found = (n for n, m in model.named_modules() if isinstance(m, _ORTHOGONAL))
    names = [re.sub(r"(^|\.)parametrizations\.", r"\1", n).rsplit(".", 1)[0] for n in found]
    if names:
        logger.warning(
            "%s parametrized orthogonal (torch.nn.utils.parametrizations.orthogonal) will be computed in %s, "
            "where its maps lose orthogonality and can go NaN (every step then skipped): train this model "
            "under a strategy with FP32 parameters (bf16-mixed, fp16-mixed, fp32)",
            ", ".join(names),
            str(dtype).removeprefix("torch."),
        )


def _refuse_fp16_overflow(model: torch.nn.Module, kept: set[int]) -> None:
    wide = (torch.float64, torch.float32, torch.bfloat16)
    named = [
        (n, p)
        for n, p in model.named_parameters()
        if p.dtype in wide and p.numel() and not p.is_meta and id(p) not in kept
    ]
    if not named:
        return
    # Once, when the model is prepared: an amax per parameter, read together (one read per device).
    by_device: dict[torch.device, list[int]] = {}
    for index, (_, p) in enumerate(named):
        by_device.setdefault(p.device, []).append(index)
    amaxes = [0.0] * len(named)
    for indices in by_device.values():
        read = torch.stack([named[i][1].detach().abs().amax().float() for i in indices]).cpu().tolist()
        for i, amax in zip(indices, read, strict=True):
            amaxes[i] = amax
    beyond = [(n, a) for (n, _), a in zip(named, amaxes) if not a < 65520.0]  # rounds to inf (NaN too)
    if beyond:
        listed = ", ".join(f"{n} (largest |value| {a:.4g})" for n, a in beyond[:5])
        more = f" and {len(beyond) - 5} more" if len(beyond) > 5 else ""
        raise ValueError(
            f"the model has parameters FP16 cannot hold (its largest finite value is 65504): {listed}{more}. "
            "Nothing was cast. Train this model with a BF16 strategy (collage-plus, bf16-mixed), or rescale those weights"
        )
