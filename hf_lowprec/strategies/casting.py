"""A trained model cast to a strategy's 16-bit dtype (`cast_model`): its parameters take the dtype,
and so do its buffers but those transformers keeps in FP32 when it loads a model in 16 bits, above
all the rotary frequencies. `Module.to` would round them too: a frequency f rounded to BF16 moves
position p's angle by up to p·f·2⁻⁸ (2⁻¹¹ in FP16), several radians at position 4,095 for the
fast-rotating pairs, angles a pretrained checkpoint never saw (docs/numerics.md, "Rotary frequencies").
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.utils.parametrizations

__all__ = ["cast_model", "fp32_module_patterns", "kept_buffers"]


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


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model.to(dtype)` but for `kept_buffers`, which keep their tensors (and dtype); in place,
    as `Module.to` is (the parameters stay the same objects). A parameter beyond FP16's range is
    refused before anything is cast to FP16: it would become inf, and every step be skipped."""
    if dtype == torch.float16:
        _refuse_fp16_overflow(model)
    _warn_orthogonal(model, dtype)
    kept = [(module, name, module._buffers[name]) for module, name in kept_buffers(model, dtype)]
    model = model.to(dtype)
    for module, name, buffer in kept:
        module._buffers[name] = buffer
    return model


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


def _refuse_fp16_overflow(model: torch.nn.Module) -> None:
    wide = (torch.float64, torch.float32, torch.bfloat16)
    named = [(n, p) for n, p in model.named_parameters() if p.dtype in wide and p.numel() and not p.is_meta]
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
