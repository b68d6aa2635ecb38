"""FP8 linear layers: E4M3 inputs and weights, E5M2 output gradients (FP8-LM §2; ALGORITHMS.md §3).

All three GEMMs of a linear layer run through `torch._scaled_mm` with per-tensor
power-of-two scales (real = payload / s) and FP32 accumulation:

    forward       y  = x·Wᵀ          x, W in E4M3
    input grad    dx = dy·W          dy in E5M2 (wider range for gradients), W in E4M3
    weight grad   dW = dyᵀ·x         dy in E5M2, x in E4M3

`torch._scaled_mm(a, b, scale_a, scale_b)` computes (a·scale_a) @ (b·scale_b): its scales
are dequantization multipliers, so it receives 1/s (exact for powers of two). Its CUDA
kernels need `a` row-major, `b` column-major and the inner and outer dimensions multiples
of 16; the CPU kernel accepts any layout (measured in torch 2.13). `_fp8_mm` always hands
it that layout and pads to 16 on CUDA, so the same code runs on both.

Only the FP8 copies of x and W are saved for backward, so activation memory for these
layers is one byte per element.

Scaled master weights (FP8-LM O2): after `scale_master_weight()`, the FP16 parameter holds
payload = real·s_m with an FP32 scale s_m in the buffer `master_scale`; the layer divides by
it when quantizing, and `p.grad` is the gradient with respect to the *real* weight (what
`FP8AdamW` and gradient clipping expect). The module's state dict holds real values in
FP32, so checkpoints and `save_pretrained` stay ordinary.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .scaled import dequantize, get_master_scale, pow2_scale, quantize, set_master_scale, tensor_amax

__all__ = ["FP8Linear", "convert_to_fp8", "fp8_linear"]

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# Dimensions _scaled_mm's CUDA kernels need to be multiples of.
GEMM_MULTIPLE = 16

ModuleFilter = Callable[[nn.Module, str], bool]

# Output dtypes torch._scaled_mm offers, hence the activation dtypes the layer accepts.
_ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _quantize_per_tensor(
    x: torch.Tensor, dtype: torch.dtype, margin: int, master_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, s) with s the power-of-two scale of the real values x / master_scale."""
    amax = tensor_amax(x)
    if master_scale is None:
        scale = pow2_scale(amax, dtype, margin)
        return quantize(x, scale, dtype), scale
    scale = pow2_scale(amax / master_scale, dtype, margin)
    # x holds real·s_m, so multiplying by s/s_m (a power of two) yields real·s.
    return quantize(x, scale / master_scale, dtype), scale


def _pad_2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if rows == t.shape[0] and cols == t.shape[1]:
        return t
    # F.pad has no FP8 kernel; zero bytes are +0.0 in both FP8 formats.
    padded = F.pad(t.view(torch.uint8), (0, cols - t.shape[1], 0, rows - t.shape[0]))
    return padded.view(t.dtype)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _fp8_mm(
    a: torch.Tensor, scale_a: torch.Tensor, bt: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(a / scale_a) @ (bt / scale_b)ᵀ for row-major FP8 `a` (M×K) and `bt` (N×K), FP32 accumulation."""
    m, k = a.shape
    n = bt.shape[0]
    if a.is_cuda:
        mp, kp, np_ = (_round_up(d, GEMM_MULTIPLE) for d in (m, k, n))
        a, bt = _pad_2d(a, mp, kp), _pad_2d(bt, np_, kp)
    out = torch._scaled_mm(
        a, bt.t(), scale_a=scale_a.reciprocal(), scale_b=scale_b.reciprocal(), out_dtype=out_dtype
    )
    return out[:m, :n]


class _FP8LinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b (or x·W + b for GPT-2 Conv1D layout) with FP8 GEMMs; backward written by hand
    because `torch._scaled_mm` has no autograd formula."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        master_scale: torch.Tensor | None,
        transposed: bool,
        margin: int,
    ) -> torch.Tensor:
        if x.dtype not in _ACTIVATION_DTYPES:
            raise ValueError(f"FP8 linear takes FP32, FP16 or BF16 inputs, got {x.dtype}")
        out_dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        x8, sx = _quantize_per_tensor(x2, E4M3, margin)
        w8, sw = _quantize_per_tensor(weight, E4M3, margin, master_scale)
        # The GEMM wants W as N×K row-major; Conv1D stores K×N.
        w_nk = w8.t().contiguous() if transposed else w8
        out = _fp8_mm(x8, sx, w_nk, sw, out_dtype)
        if bias is not None:
            out = out + bias.to(out_dtype)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.transposed = transposed
        ctx.margin = margin
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8, sx, w8, sw = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g8, sg = _quantize_per_tensor(g2, E5M2, ctx.margin)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dx = dy·W: the second operand, as N×K row-major "bt", is Wᵀ (K×N) for Linear, W for Conv1D.
            w_kn = w8 if ctx.transposed else w8.t().contiguous()
            grad_x = _fp8_mm(g8, sg, w_kn, sw, ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            g_t = g8.t().contiguous()
            x_t = x8.t().contiguous()
            if ctx.transposed:  # dW (K×N) = xᵀ·dy
                grad_w = _fp8_mm(x_t, sx, g_t, sg, ctx.weight_dtype)
            else:  # dW (N×K) = dyᵀ·x
                grad_w = _fp8_mm(g_t, sg, x_t, sx, ctx.weight_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            # The bias gradient is a cheap reduction: keep it exact rather than FP8.
            grad_b = g2.float().sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_transposed: bool = False,
    margin: int = 0,
    master_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Functional FP8 linear: x·Wᵀ + b (x·W + b when `weight_transposed`, GPT-2 Conv1D layout).

    Args:
        x: input (..., K) in FP32, FP16 or BF16; the output has the same dtype.
        weight: N×K (or K×N when `weight_transposed`).
        margin: scale margin in binades for every FP8 cast.
        master_scale: when the weight is a scaled master (payload = real·s_m), its scale.
    """
    k = weight.shape[0] if weight_transposed else weight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, weight expects {k}")
    return _FP8LinearFunction.apply(x, weight, bias, master_scale, weight_transposed, margin)


class FP8Linear(nn.Module):
    """Drop-in replacement for `nn.Linear` (and GPT-2's `Conv1D`) with FP8 GEMMs.

    Parameter names and shapes are those of the module it replaces (`weight`, `bias`), so
    existing state dicts load unchanged.

    Args:
        in_features, out_features: as in `nn.Linear`.
        bias: whether the layer has a bias.
        weight_transposed: weight stored as in_features × out_features (Conv1D layout).
        margin: scale margin in binades for the FP8 casts.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        weight_transposed: bool = False,
        margin: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.in_features = in_features
        self.out_features = out_features
        self.weight_transposed = weight_transposed
        self.margin = margin
        shape = (in_features, out_features) if weight_transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.register_buffer("master_scale", None, persistent=False)
        self.master_margin = 0
        self.register_state_dict_post_hook(_export_real_weight)
        self.register_load_state_dict_pre_hook(_import_real_weight)

    @classmethod
    def from_float(cls, module: nn.Module, *, margin: int = 0) -> FP8Linear:
        """An FP8Linear that shares `module`'s parameters (no copy): `nn.Linear` or `Conv1D`."""
        transposed = not isinstance(module, nn.Linear)
        in_features, out_features = (module.weight.shape if transposed else module.weight.shape[::-1])
        new = cls(
            in_features, out_features, bias=module.bias is not None,
            weight_transposed=transposed, margin=margin, device="meta",
        )  # fmt: skip
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new

    def scale_master_weight(self, margin: int = 0) -> None:
        """Turn the FP16 weight into a scaled master: payload = real·s_m, s_m a power of two for FP16."""
        if self.weight.dtype != torch.float16:
            raise ValueError(f"scaled master weights are FP16; this weight is {self.weight.dtype} (cast the model first)")
        if self.master_scale is not None:
            return
        shared = get_master_scale(self.weight)
        if shared is not None:  # a tied weight, already scaled by the other layer that holds it
            self.master_scale, self.master_margin = shared, margin
            return
        with torch.no_grad():
            scale = pow2_scale(tensor_amax(self.weight), torch.float16, margin)
            self.weight.copy_(quantize(self.weight, scale, torch.float16))
        self.master_margin = margin
        self.master_scale = scale
        set_master_scale(self.weight, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.master_scale
        if scale is not None and get_master_scale(self.weight) is not scale:
            set_master_scale(self.weight, scale)
        return _FP8LinearFunction.apply(x, self.weight, self.bias, scale, self.weight_transposed, self.margin)

    def extra_repr(self) -> str:
        layout = ", conv1d_layout" if self.weight_transposed else ""
        master = ", scaled_fp16_master" if self.master_scale is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, margin={self.margin}{layout}{master}"
        )


def _export_real_weight(module: FP8Linear, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    # Real values of a scaled FP16 master can lie below FP16's normal range: export them in FP32.
    if module.master_scale is not None and prefix + "weight" in state_dict:
        state_dict[prefix + "weight"] = dequantize(module.weight.detach(), module.master_scale, torch.float32)


def _import_real_weight(module: FP8Linear, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    key = prefix + "weight"
    if module.master_scale is None or key not in state_dict:
        return
    real = state_dict[key]
    scale = pow2_scale(tensor_amax(real), torch.float16, module.master_margin).to(module.master_scale.device)
    state_dict[key] = quantize(real, scale, torch.float16)
    module.master_scale.copy_(scale)


def _conv1d_class() -> type | None:
    # A model built from GPT-2's Conv1D has imported its module already; looking it up instead
    # of importing keeps conversion of plain torch models free of the transformers import.
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def _default_skips(model: nn.Module) -> dict[int, str]:
    """id(module) → reason, for the LM head and layers whose weight is an embedding's."""
    skips: dict[int, str] = {}
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is not None and id(weight) in embedding_weights and not isinstance(module, nn.Embedding):
            skips[id(module)] = "its weight is tied to an embedding"
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, nn.Module):
        skips[id(head)] = "it is the LM head (output embeddings), which FP8 degrades most"
    return skips


def convert_to_fp8(
    model: nn.Module, *, module_filter: ModuleFilter | None = None, margin: int = 0
) -> nn.Module:
    """Swap `nn.Linear` and GPT-2 `Conv1D` layers for `FP8Linear`, in place; returns `model`.

    Args:
        model: any module tree.
        module_filter: `filter(module, fqn) -> bool`, True to convert. It replaces the default
            filter, which skips the LM head and layers tied to embeddings.
        margin: scale margin for the FP8 casts of the new layers.

    Layers whose two dimensions are not multiples of 16 (what `_scaled_mm` needs on CUDA)
    and subclasses of `nn.Linear` (whose own forward a swap would drop) are always skipped.
    Each skip is logged as a warning naming the layer and the reason.
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    if module_filter is not None and not callable(module_filter):
        raise ValueError(f"module_filter must be a callable filter(module, fqn) -> bool, got {module_filter!r}")
    conv1d = _conv1d_class()
    default_skips = _default_skips(model) if module_filter is None else {}
    swaps: list[tuple[str, nn.Module]] = []
    skipped: dict[str, str] = {}
    for fqn, module in model.named_modules():
        is_linear = isinstance(module, nn.Linear)
        is_conv1d = conv1d is not None and type(module) is conv1d
        if not (is_linear or is_conv1d):
            continue
        name = fqn or "<root>"
        if module_filter is not None and not module_filter(module, fqn):
            logger.info("FP8: kept %s in high precision (rejected by module_filter)", name)
            skipped[name] = "rejected by module_filter"
            continue
        reason = default_skips.get(id(module))
        if reason is None and is_linear and type(module) is not nn.Linear:
            reason = f"it is a subclass of nn.Linear ({type(module).__name__}) with its own behaviour"
        if reason is None:
            k, n = (module.weight.shape if is_conv1d else module.weight.shape[::-1])
            bad = [f"{label}={d}" for label, d in (("in_features", k), ("out_features", n)) if d % GEMM_MULTIPLE]
            if bad:
                reason = f"{', '.join(bad)} not a multiple of {GEMM_MULTIPLE} (FP8 GEMM requirement)"
        if reason is not None:
            logger.warning("FP8: skipped layer %s: %s", name, reason)
            skipped[name] = reason
            continue
        swaps.append((fqn, module))
    if any(fqn == "" for fqn, _ in swaps):
        raise ValueError("convert_to_fp8 converts layers inside a model; wrap a bare layer with FP8Linear.from_float")
    for fqn, module in swaps:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP8Linear.from_float(module, margin=margin))
    logger.info("FP8: converted %d layers to FP8Linear", len(swaps))
    # Read by the startup report (hf_lowprec.report.describe): which layers stayed high precision and why.
    model.__dict__.setdefault("fp8_skipped_layers", {}).update(skipped)
    return model
