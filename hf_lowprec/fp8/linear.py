"""FP8 linear layers: E4M3 inputs and weights, FP8 output gradients (FP8-LM §2; docs/algorithms.md §3).

This module is long because the autograd function and the module share one quantization
contract (the weight cache, shared inputs, FP8-stored weights, gradient sinks, state-dict
hooks); split, each half would restate it. A layer's `FP8LinearConfig` (`fp8.scaling_recipes`)
says how it scales and which GEMM path it prefers; `convert.convert_to_fp8` swaps layers.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..compiling import in_compiled_model, in_torch_func, takes_gpu_path
from ..distributed import DTensor, local_shard, sharded_like
from .fused import counted_input_cast, tensorwise_cast, tensorwise_cast_transposed
from .gemm import (
    GEMM_OUT_DTYPE,
    GemmPath,
    ScaledMMGemm,
    fp8_gemm_path,
    fp8_mm,
    gemm_for,
    inverse_scales,
    set_fp8_gemm_path,
)
from .raised import count_flushes, raised_linear
from .scaled import (
    FP8WeightCopy,
    dequantize,
    fp32_scale,
    get_fp8_weight_copy,
    get_master_scale,
    pow2_scale,
    quantize,
    set_fp8_weight_copy,
    set_master_scale,
    tensor_amax,
)
from .scaling_recipes import (
    FP8LinearConfig,
    ScalingRecipe,
    fp8_config,
    native_kernel,
    recipe_backward,
    recipe_forward,
    recipe_weight,
)
from .second_order import fp8_gemm_refusal, keep_inputs, refuses_double_backward

__all__ = [
    "FP8Linear",
    "FP8LinearFunction",
    "GemmPath",
    "GradSink",
    "accumulates_into",
    "deliver_weight_grad",
    "fp8_gemm_path",
    "fp8_linear",
    "get_grad_sink",
    "optimizer_step_generation",
    "output_dtype",
    "quantize_layer_weight",
    "quantize_tensorwise",
    "quantize_weight",
    "set_fp8_gemm_path",
    "set_grad_sink",
    "share_inputs_within",
    "sharing_inputs",
]

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

# A sink returns what autograd should still receive: None when it took the gradient.
GradSink = Callable[[torch.Tensor], torch.Tensor | None]
_GRAD_SINK_ATTR = "_hf_lowprec_grad_sink"

# Output dtypes torch._scaled_mm offers, hence the activation dtypes the layer accepts.
_ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def quantize_tensorwise(
    x: torch.Tensor, dtype: torch.dtype, margin: int, master_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, s) with s the power-of-two scale of the real values x / master_scale.

    Two passes over x, amax then x·s in FP32 and the cast, in one compiled graph
    (`fused.tensorwise_cast`: one or two kernels, on CPU and CUDA). The scale comes from this
    tensor's own amax, so |x·s| ≤ max(dtype) already and `quantize`'s saturating clamp has
    nothing to do. A non-finite amax (an inf or NaN anywhere in x) makes the whole payload NaN,
    so the overflow stays visible downstream, as with `quantize`.
    """
    return tensorwise_cast(x, dtype, margin, master_scale)


def quantize_weight(
    weight: torch.Tensor, margin: int = 0, master_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 payload, scale) of `weight` as an FP8 layer's forward quantizes it (real = payload /
    scale); `master_scale` when the weight is a scaled master (payload = real·s_m)."""
    return quantize_tensorwise(weight, E4M3, margin, master_scale)


def set_grad_sink(param: torch.Tensor, sink: GradSink | None) -> None:
    """Send the weight gradient of `param` to `sink(grad)` instead of `param.grad` (None: undo).

    `grad` is the gradient with respect to the real weight, in BF16 (the FP8 GEMM's output),
    once per backward; the sink owns accumulation across micro-batches. The sink returns None
    when it took the gradient, or a gradient autograd accumulates into `param.grad` as usual.
    """
    if sink is None:
        if hasattr(param, _GRAD_SINK_ATTR):
            delattr(param, _GRAD_SINK_ATTR)
        return
    setattr(param, _GRAD_SINK_ATTR, sink)


def get_grad_sink(param: torch.Tensor) -> GradSink | None:
    """The gradient sink set on `param` by `set_grad_sink`, or None; None too while `param` is
    frozen (`requires_grad_(False)`): a frozen weight's gradient is not taken, as autograd's is not,
    and inside a compiled graph for a sink marked `eager_only` (its Python state would break the
    graph; autograd then gives `param.grad`)."""
    sink = getattr(param, _GRAD_SINK_ATTR, None) if param.requires_grad else None
    return None if getattr(sink, "eager_only", False) and torch.compiler.is_compiling() else sink


# --- weight cache: one quantization per optimizer step ------------------------------------
# Optimizers that write through `p.data` do not bump the parameter's version counter, so
# every optimizer step also bumps this counter (a global step post-hook, registered when the
# first FP8Linear is built) and drops the cached copies, whose memory the step can use.
_optimizer_steps = itertools.count()
_step_generation = 0
_caching_layers: weakref.WeakSet[FP8Linear] = weakref.WeakSet()
_hook_handle: Any = None


def _after_optimizer_step(*_: Any) -> None:
    global _step_generation
    _step_generation = next(_optimizer_steps) + 1
    for layer in list(_caching_layers):
        layer._weight_cache = layer._written_weight()


def optimizer_step_generation() -> int:
    """How many optimizer steps have run in this process (any optimizer): what FP8 weight caches
    and FSDP2's agreed weight scales are keyed by."""
    return _step_generation


def _ensure_step_hook() -> None:
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_post_hook(_after_optimizer_step)


# --- one input, several layers (q/k/v, gate/up projections) --------------------------------
# Inside `sharing_inputs()` an FP8 layer handed the very tensor another layer of the scope
# quantized reuses its (payload, scale): one quantization, one saved FP8 copy. Recognised by
# identity and version counter, never by comparing values (no host sync). Eager only: under
# torch.compile the scope is not consulted (dynamo cannot replay the dictionary).
_input_scopes: list[dict[int, tuple[Any, ...]]] = []  # id(x) → (x, version, margin, x8, x8ᵀ, sx, counts)


def _quantize_input(x: torch.Tensor, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_tensorwise(x.detach().reshape(-1, x.shape[-1]), E4M3, margin)


@contextlib.contextmanager
def sharing_inputs() -> Iterator[None]:
    """Within the scope, FP8 layers given the same input tensor quantize it once (see above)."""
    _input_scopes.append({})
    try:
        yield
    finally:
        _input_scopes.pop()


def _shared_input(x: torch.Tensor, margin: int, counted: bool, transposed: bool) -> tuple[Any, ...]:
    """(x8, x8ᵀ or None, sx, counts) from the innermost `sharing_inputs` scope, quantized now if it
    is new; () outside one. `counted`: with the cast's flush counts (`fused.counted_input_cast`),
    else counts is None; `transposed`: the payload transposed too, written by the same graph
    (a layer that finds it missing leaves the transposing copy to its backward)."""
    if not _input_scopes or torch.compiler.is_compiling() or x.is_inference() or in_torch_func():
        return ()  # no version counter (an inference tensor, a torch.func transform's wrapper)
    scope = _input_scopes[-1]
    hit = scope.get(id(x))
    if hit is not None and hit[0] is x and hit[1:3] == (x._version, margin) and (hit[6] is not None or not counted):
        return hit[3], hit[4] if transposed else None, hit[5], hit[6]
    x2 = x.detach().reshape(-1, x.shape[-1])
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        if counted:
            x8, x8_t, sx, counts = counted_input_cast(x2, margin, transposed)
        elif transposed:
            (x8, x8_t, sx), counts = tensorwise_cast_transposed(x2, E4M3, margin), None
        else:
            (x8, sx), x8_t, counts = _quantize_input(x, margin), None, None
    scope[id(x)] = (x, x._version, margin, x8, x8_t, sx, counts)
    return x8, x8_t, sx, counts


def share_inputs_within(model: nn.Module) -> int:
    """Open a `sharing_inputs` scope around the forward of each module of `model` with two or
    more FP8 layers among its children (attention's q, k and v projections; a gated MLP's gate
    and up): its layers handed one tensor quantize it once and save one FP8 copy (two casts and
    two saved copies fewer per decoder layer, and one in a gated MLP). Eager only, as the scope;
    a compiled graph holds one cast of a tensor anyway (common subexpressions are merged).
    Returns how many modules it opened scopes around."""
    opened = 0
    for module in model.modules():
        if _open_scope in module._forward_pre_hooks.values():
            continue
        if sum(isinstance(child, FP8Linear) for child in module.children()) >= 2:
            module.register_forward_pre_hook(_open_scope)
            module.register_forward_hook(_close_scope, always_call=True)
            opened += 1
    return opened


_OPENED = "_hf_lowprec_opened_scopes"  # on a module: the scopes its calls opened, innermost last


def _open_scope(module: nn.Module, args: Any) -> None:
    if not torch.compiler.is_compiling():
        _input_scopes.append({})
        module.__dict__.setdefault(_OPENED, []).append(_input_scopes[-1])


def _close_scope(module: nn.Module, args: Any, output: Any) -> None:
    """Closes the scope this module's call opened, and no other (a call whose pre-hook did not
    run, or ran traced, opened none)."""
    opened = None if torch.compiler.is_compiling() else module.__dict__.get(_OPENED)
    if opened and _input_scopes and _input_scopes[-1] is opened[-1]:
        opened.pop()
        _input_scopes.pop()


def _transposes_input(x: torch.Tensor, weight: torch.Tensor, config: FP8LinearConfig, sink: Any, grad: bool) -> bool:
    """Whether the forward's cast writes x's payload transposed too: on the `torch._scaled_mm`
    path, when a weight gradient dW = dyᵀ·x will be taken (it wants x column-major)."""
    wants_dw = grad and (weight.requires_grad or sink is not None)
    return wants_dw and isinstance(gemm_for(x.device, config.gemm_path), ScaledMMGemm)


VMAP_REFUSED = (
    "torch.func.vmap over an FP8 linear layer (strategies fp8-lm-o1, fp8-lm-o2, fp8-lm-o3, coat) is not "
    "supported: its FP8 casts and GEMMs have no batching rule. torch.func.grad and vjp over "
    "functional_call work; for per-sample gradients call torch.func.grad once per sample, or use a "
    "strategy without FP8 layers (bf16-mixed)"
)


class FP8LinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b (or x·W + b for GPT-2 Conv1D layout) with FP8 GEMMs under `config`; backward
    written by hand because the FP8 GEMMs have no autograd formula.

    forward       y  = x·Wᵀ          x, W in E4M3
    input grad    dx = dy·W          dy in the recipe's gradient format (E5M2 tensorwise), W in E4M3
    weight grad   dW = dyᵀ·x         dy as above, x in E4M3

    A whole-tensor recipe (tensorwise) runs the GEMMs of `fp8.gemm` on the saved FP8 x and W; the
    finer recipes run `fp8.scaling_recipes`' GEMMs, which re-quantize along the other axis.
    A backward under create_graph is refused (`fp8.second_order`): those operands carry no graph.
    """

    @staticmethod
    def forward(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        w8: torch.Tensor,
        sw: torch.Tensor,
        config: FP8LinearConfig,
        transposed: bool,
        out_dtype: torch.dtype,
        grad_sink: GradSink | None = None,
        x8: torch.Tensor | None = None,
        sx: torch.Tensor | None = None,
        grad_enabled: bool = True,
        x8_t: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        """(y, then what backward needs that this call made: x8, x8ᵀ, sx, 1/s_x, 1/s_w; None where
        given or not made). The `forward` + `setup_context` form that torch.func transforms require."""
        given = x8 is not None
        gemm = gemm_for(x.device, config.gemm_path)
        inverses = [None, None]
        # The FP8 numerics are the layer's own: no ambient autocast may recast an operand here.
        with torch.autocast(x.device.type, enabled=False):
            if not config.recipe.whole_tensor:  # the finer recipes' scales and GEMMs
                native = isinstance(gemm, ScaledMMGemm) and native_kernel(config.recipe, x.device)
                x2 = x.detach().reshape(-1, x.shape[-1])
                out, x8, sx = recipe_forward(config, x2, w8, sw, transposed, native)
            else:
                if x8 is None:  # not quantized already (`sharing_inputs`, or the guard's counted cast)
                    if _transposes_input(x, weight, config, grad_sink, grad_enabled):
                        # The weight gradient's GEMM takes x's payload transposed: written by the
                        # cast's own graph now, where backward would launch a transposing copy.
                        x8, x8_t, sx = tensorwise_cast_transposed(
                            x.detach().reshape(-1, x.shape[-1]), E4M3, config.margin
                        )
                    else:
                        x8, sx = _quantize_input(x, config.margin)
                # Logical B operand of y = x·B: Wᵀ for Linear (N×K storage), W for Conv1D (K×N).
                # 1/s_x and 1/s_w in one launch, kept for backward's two GEMMs.
                inverses = inverse_scales(sx, sw)
                out = fp8_mm(x8, sx, w8 if transposed else w8.t(), sw, GEMM_OUT_DTYPE, gemm, inverses)
            # The bias is added to the BF16 GEMM result in FP32 (type promotion), then the sum
            # is rounded once to the output dtype.
            out = (out if bias is None else torch.add(out, bias)).to(out_dtype)
        # 2-D: a view made here would be one autograd forbids writing in place (Llama4's
        # `shared_expert(h).add_(...)`); `_unflatten` reshapes it outside, where views may be written.
        return (out, None, None, None, *inverses) if given else (out, x8, x8_t, sx, *inverses)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor | None, ...]) -> None:
        """Saves the FP8 operands for backward: those `forward` made (its extra outputs, marked
        non-differentiable) or was given."""
        padded = (*inputs, *[None] * 5)[:13]
        x, weight, bias, w8, sw, config, transposed, _, grad_sink, x8, sx, _, x8_t = padded
        if x8 is None:  # made by `forward`
            _, x8, x8_t, sx, inv_x, inv_w = output
        else:
            inv_x, inv_w = output[4:]
        ctx.mark_non_differentiable(*(t for t in output[1:] if t is not None))
        ctx.set_materialize_grads(False)  # no zeros for the extra outputs' (absent) gradients
        ctx.x_transposed = x8_t is not None  # what is saved: x8ᵀ (K×M, contiguous) instead of x8
        ctx.save_for_backward(x8_t if x8_t is not None else x8, sx, w8, sw, inv_x, inv_w)
        ctx.config = config
        ctx.transposed = transposed
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.weight_dtype = weight.dtype
        ctx.grad_sink = grad_sink
        ctx.bias_dtype = None if bias is None else bias.dtype
        keep_inputs(ctx, x, weight, bias)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        """Refused with the reason and the fix: the FP8 GEMMs and casts have no batching rule."""
        raise NotImplementedError(VMAP_REFUSED)

    @staticmethod
    @refuses_double_backward(lambda ctx: fp8_gemm_refusal("an FP8 linear layer"))
    def backward(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        x8, sx, w8, sw, inv_x, inv_w = ctx.saved_tensors
        config = ctx.config
        gemm = gemm_for(grad_out.device, config.gemm_path)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        sink = ctx.grad_sink
        need_dw = ctx.needs_input_grad[1] or sink is not None
        if not config.recipe.whole_tensor:
            native = isinstance(gemm, ScaledMMGemm) and native_kernel(config.recipe, grad_out.device)
            with torch.autocast(grad_out.device.type, enabled=False):
                args = (ctx.transposed, native, ctx.needs_input_grad[0], need_dw)
                grad_x, grad_w = recipe_backward(config, g2, x8, sx, w8, sw, *args)
            if grad_x is not None:
                grad_x = grad_x.to(ctx.x_dtype).reshape(ctx.x_shape)
        else:
            if need_dw and isinstance(gemm, ScaledMMGemm):
                # dyᵀ·x needs dy's payload transposed too: written by the same graph as dy's.
                g8, g_t, sg = tensorwise_cast_transposed(g2, config.recipe.grad_dtype, config.margin)
                g_op = g8
            else:
                g8, sg = quantize_tensorwise(g2, config.recipe.grad_dtype, config.margin)
                g_op = gemm.operand(g8)
                g_t = g_op.t()
            inv_g = sg.reciprocal()  # with the forward's 1/s_x and 1/s_w: one launch, not two
            if ctx.needs_input_grad[0]:
                # dx = dy·W for Linear (W is N×K), dy·Wᵀ for Conv1D (W is K×N).
                w_op = gemm.operand(w8.t() if ctx.transposed else w8)
                grad_x = gemm.mm(g_op, sg, w_op, sw, (inv_g, inv_w)).to(ctx.x_dtype).reshape(ctx.x_shape)
            if need_dw:
                # x as (M×K), a view of the saved x8ᵀ where the forward wrote it: the layouts
                # `torch._scaled_mm` takes, so no copy is made here.
                x_op = x8.t() if getattr(ctx, "x_transposed", False) else gemm.operand(x8)
                if ctx.transposed:  # dW (K×N) = xᵀ·dy
                    grad_w = gemm.mm(x_op.t(), sx, g_t.t(), sg, (inv_x, inv_g))
                else:  # dW (N×K) = dyᵀ·x
                    grad_w = gemm.mm(g_t, sg, x_op, sx, (inv_g, inv_x))
        if need_dw:
            grad_w = deliver_weight_grad(grad_w, sink, ctx.weight_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            # The bias gradient is a cheap reduction: keep it exact rather than FP8.
            grad_b = g2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None, None


def deliver_weight_grad(grad_w: torch.Tensor, sink: GradSink | None, weight_dtype: torch.dtype) -> torch.Tensor | None:
    """What an FP8 GEMM's backward returns for its weight: None after the weight's sink took the
    gradient, None for an FP8-stored weight without one, else the gradient (the one the sink gave
    back, if any) in its dtype."""
    if sink is not None:
        grad_w = sink(grad_w)
        if grad_w is None:
            return None
    if weight_dtype in (E4M3, E5M2):
        return None  # an FP8-stored weight's gradient exists only through a sink
    return grad_w.to(weight_dtype)


def accumulates_into(param: torch.Tensor) -> bool:
    """Whether the backward now running accumulates into `param.grad` (a sink may take the gradient):
    not under `torch.autograd.grad` (which returns gradients and accumulates none), nor a
    `backward(inputs=...)` that leaves `param` out, nor where a hook of the user's
    (`param.register_hook`) waits to see the gradient. Host-side: no kernel, no sync."""
    if param._backward_hooks:
        return False
    with torch.enable_grad():  # a backward runs without grad mode: the view would have no grad_fn
        accumulator = param.view_as(param).grad_fn.next_functions[0][0]
    try:
        return torch._C._will_engine_execute_node(accumulator)
    except RuntimeError:  # torch refuses a leaf's node under autograd.grad, which accumulates nothing
        return False


def _check_input_dtype(x: torch.Tensor) -> None:
    if x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"FP8 linear takes FP32, FP16 or BF16 inputs, got {x.dtype}; cast the input first")


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The input's dtype, or under autocast its dtype, as autocast gives `nn.Linear`'s output.

    Only the output's rounding follows autocast: the GEMM result is BF16 whatever the output
    dtype (`GEMM_OUT_DTYPE`), so under BF16 autocast the output is exactly the FP32-input
    layer's output rounded to BF16, and the FP8 operands and what is saved are the same.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if dtype in _ACTIVATION_DTYPES:
            return dtype
    return x.dtype


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_transposed: bool = False,
    master_scale: torch.Tensor | None = None,
    config: FP8LinearConfig | None = None,
    margin: int = 0,
    recipe: str | ScalingRecipe = "tensorwise",
) -> torch.Tensor:
    """Functional FP8 linear: x·Wᵀ + b (x·W + b when `weight_transposed`, GPT-2 Conv1D layout).

    Args:
        x: input (..., K) in FP32, FP16 or BF16; the output has the same dtype (the autocast
            dtype under autocast, see `output_dtype`).
        weight: N×K (or K×N when `weight_transposed`).
        master_scale: when the weight is a scaled master (payload = real·s_m), its scale.
        config: the layer configuration (`fp8_config`); without one, `margin` (binades for every
            FP8 cast) and `recipe` (a name of `SCALING_RECIPES`) build it.
    """
    config = config or fp8_config(recipe, margin)
    k = weight.shape[0] if weight_transposed else weight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, weight expects {k}")
    _check_input_dtype(x)
    w8, sw = quantize_layer_weight(config, weight, weight_transposed, master_scale)
    out = FP8LinearFunction.apply(
        x, weight, bias, w8, sw, config, weight_transposed, output_dtype(x), None, None, None, torch.is_grad_enabled()
    )[0]
    return unflatten(out, x)


def unflatten(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A GEMM function's 2-D output in `x`'s leading dimensions (a view autograd lets be written)."""
    return out.reshape(*x.shape[:-1], out.shape[-1])


def quantize_layer_weight(
    config: FP8LinearConfig, weight: torch.Tensor, transposed: bool, master_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's FP8 weight under `config`: (E4M3 payload in the storage layout, scales)."""
    if config.recipe.whole_tensor:
        return quantize_tensorwise(weight, E4M3, config.margin, master_scale)
    return recipe_weight(config, weight, transposed, master_scale)


class FP8Linear(nn.Module):
    """Drop-in replacement for `nn.Linear` (and GPT-2's `Conv1D`) with FP8 GEMMs.

    Parameter names and shapes are those of the module it replaces (`weight`, `bias`), so
    existing state dicts load unchanged.

    Args:
        in_features, out_features: as in `nn.Linear`.
        bias: whether the layer has a bias.
        weight_transposed: weight stored as in_features × out_features (Conv1D layout).
        config: the layer configuration (`fp8_config`: recipe, margin, GEMM path); without one,
            `margin` (binades for every FP8 cast) and `recipe` (a name of `SCALING_RECIPES`)
            build it.

    In training the weight is quantized once per optimizer step: the FP8 weight is cached
    under the weight's version counter and a global optimizer-step counter, so gradient
    accumulation's micro-batches and training-mode rollouts reuse it, and an optimizer step,
    `load_state_dict`, `.to()` or an in-place op on the weight invalidates it; a write through
    `weight.data` between two training forwards of one step is not seen: call
    `forget_weight_cast()` after it. In eval mode without autograd (evaluation, `generate`) the
    weight is cast at every forward and nothing is cached. Only the FP8 copies of x and W are
    saved for backward.

    Watched by the guard (`watch_flushes`), a training forward leaves in `flush_now` its input
    casts' counts [flushed to zero, non-zero] (int64, on the device), which the guard collects
    after the model's forward; a layer called twice in one forward is judged by its last call.
    """

    watch_flushes = False
    flush_now: torch.Tensor | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        weight_transposed: bool = False,
        config: FP8LinearConfig | None = None,
        margin: int = 0,
        recipe: str | ScalingRecipe = "tensorwise",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config or fp8_config(recipe, margin)
        self.in_features = in_features
        self.out_features = out_features
        self.weight_transposed = weight_transposed
        shape = (in_features, out_features) if weight_transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.register_buffer("master_scale", None, persistent=False)
        self.master_margin = 0
        self._weight_cache: tuple[tuple, torch.Tensor, torch.Tensor] | None = None
        self._copy_owner: tuple[torch.Tensor] | None = None  # the weight its FP8 copy is linked to
        _ensure_step_hook()
        self.register_state_dict_post_hook(_export_real_weight)
        self.register_load_state_dict_pre_hook(_import_real_weight)

    @classmethod
    def from_float(
        cls,
        module: nn.Module,
        *,
        config: FP8LinearConfig | None = None,
        margin: int = 0,
        recipe: str | ScalingRecipe = "tensorwise",
    ) -> FP8Linear:
        """An FP8Linear that shares `module`'s parameters (no copy): `nn.Linear` or `Conv1D`."""
        transposed = not isinstance(module, nn.Linear)
        in_features, out_features = module.weight.shape if transposed else module.weight.shape[::-1]
        new = cls(
            in_features,
            out_features,
            bias=module.bias is not None,
            weight_transposed=transposed,
            config=config or fp8_config(recipe, margin),
            device="meta",
        )
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new

    @property
    def recipe(self) -> str:
        """The name of the layer's recipe ("bf16" once the guard raised it)."""
        return self.config.name

    @property
    def margin(self) -> int:
        """Scale margin in binades of the layer's FP8 casts."""
        return self.config.margin

    def set_config(self, config: FP8LinearConfig) -> None:
        """Run under `config` from the next forward (the guard raising a layer's recipe)."""
        self.config = config
        self._weight_cache = None  # quantized under the old configuration

    def scale_master_weight(self, margin: int = 0) -> None:
        """Turn the weight into a scaled master (FP8-LM O2): FP16 payload = real·s_m, s_m a power of
        two for FP16 chosen from the weight's own values, kept in the buffer `master_scale`.

        The layer divides by s_m when quantizing, and `p.grad` is the gradient with respect to the
        *real* weight (what `hf_lowprec.optim.FP8AdamW` and gradient clipping expect). The state dict holds real
        values in FP32, so checkpoints and `save_pretrained` stay ordinary. An FP8-stored weight
        (fp8-lm-o3) holds the E4M3 payload itself with its scale in `master_scale`, and is used as
        the FP8 weight without quantizing again; its gradient exists only through a sink
        (`set_grad_sink`).
        """
        if self.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"scaled master weights are made from a 16- or 32-bit weight; this one is {self.weight.dtype}"
            )
        if self.master_scale is not None:
            return
        shared = get_master_scale(self.weight)
        if shared is not None:  # a tied weight, already scaled by the other layer that holds it
            self.master_scale, self.master_margin = shared, margin
            return
        if self.weight.is_meta:  # no values to scale (memory planning): the scale's place only
            scale = torch.ones((), dtype=torch.float32, device="meta")
            self.weight.data = self.weight.data.to(torch.float16)
        else:  # scaled from the real values: none overflows or falls to an FP16 subnormal first
            with torch.no_grad():
                scale = pow2_scale(tensor_amax(self.weight), torch.float16, margin)
                self.weight.data = quantize(self.weight.data, scale, torch.float16)
        self.master_margin = margin
        self.master_scale = scale
        set_master_scale(self.weight, scale)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FP8Linear:
        # `.to()` / `.cuda()` replace the buffer `master_scale` with a new tensor: relink it to the
        # weight now, so that an optimizer reading `get_master_scale` before the next forward
        # (FP8 ZeRO's weight exchange right after DeepSpeed moved the model) sees the live one.
        # `.half()` casts every floating buffer too: a scale past 65504 (any weight below ~1 has
        # one) became inf, every forward and export then divided by it. It stays FP32.
        before = self.master_scale
        out = super()._apply(fn, recurse)
        if before is not None:
            self.master_scale = fp32_scale(before, self.master_scale)
            set_master_scale(self.weight, self.master_scale)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.master_scale
        if scale is not None and get_master_scale(self.weight) is not scale:
            set_master_scale(self.weight, scale)
        _check_input_dtype(x)
        config = self.config
        # Under a torch.func transform the weight gradient is the transform's result: no sink takes
        # it, and the guard's counts (a training step's) are not taken.
        functional = in_torch_func()
        sink = None if functional else get_grad_sink(self.weight)
        if config.raised:  # raised by the guard (fp8/raised.py)
            return raised_linear(self, x, output_dtype(x), sink, deliver_weight_grad)
        # The guard watches this layer's input casts in a training step's forward (not under no_grad).
        counted = self.watch_flushes and self.training and torch.is_grad_enabled() and not functional
        w8, sw = self._fp8_weight()
        x8 = sx = x8_t = None
        if config.recipe.whole_tensor:
            # Inputs are shared in their whole-tensor quantization only: the finer recipes quantize
            # x with the layer's own blocks in the autograd function.
            transposes = _transposes_input(x, self.weight, config, sink, torch.is_grad_enabled())
            shared = _shared_input(x, config.margin, counted, transposes)
            if shared:
                x8, x8_t, sx, counts = shared
            elif counted:  # the cast the function would make, with its flush counts in its graph
                with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                    transposed = _transposes_input(x, self.weight, config, sink, True)
                    x8, x8_t, sx, counts = counted_input_cast(x.reshape(-1, x.shape[-1]), config.margin, transposed)
            if counted:
                self.flush_now = counts
        elif counted:
            self.flush_now = count_flushes(x, config)
        out = FP8LinearFunction.apply(
            x,
            self.weight,
            self.bias,
            w8,
            sw,
            config,
            self.weight_transposed,
            output_dtype(x),
            sink,
            x8,
            sx,
            torch.is_grad_enabled(),  # no weight gradient under no_grad: no transposed x is written
            x8_t,
        )[0]
        return unflatten(out, x)

    def _fp8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, scale) of the weight in E4M3, quantized once per optimizer step (class docstring)."""
        weight, scale = self.weight, self.master_scale
        gathered = getattr(weight, "fp8", None)  # FSDP2's FP8 all-gather output (fp8/sharded_weight.py)
        if gathered is not None:
            return gathered()
        if weight.dtype == E4M3:  # an FP8-stored weight is its own FP8 weight (`scale_master_weight`)
            if scale is None:
                raise ValueError("an FP8-stored weight needs its scale in master_scale (real = payload / scale)")
            return weight.detach(), scale
        evaluating = not self.training and not torch.is_grad_enabled()
        if evaluating or in_compiled_model() or torch.is_inference_mode_enabled() or in_torch_func():
            # An eval-mode forward without autograd (evaluation, generate) casts the weight every
            # time, as torchao's float8 layers always do: what is evaluated or generated is the
            # weight as it is now, whatever wrote it (an EMA swap or a load through `.data` bumps
            # no version the cache key sees). A loop that trains without `model.train()` (a model
            # from `from_pretrained` starts in eval mode) keeps the cache: autograd is on.
            # In a compiled graph the cast is fused into the graph and runs at every forward: a
            # cache keyed by the optimizer step would be a Python value that changes per step,
            # hence a guard, hence a new graph at every step. An inference tensor kept in the
            # cache could not be saved for a later training backward. Within a torch.func
            # transform the weight (`functional_call`'s) is a wrapper with no storage to key a cache by.
            return quantize_layer_weight(self.config, weight, self.weight_transposed, scale)
        key = self._cache_key()
        cached = self._weight_cache
        if cached is not None and cached[0] == key:
            copy = get_fp8_weight_copy(weight)
            if copy is not None and copy.payload is cached[1]:
                copy.used = True  # FP8AdamW writes the next one
            return cached[1], cached[2]
        w8, sw = quantize_layer_weight(self.config, weight, self.weight_transposed, scale)
        self._weight_cache = (key, w8, sw)
        _caching_layers.add(self)
        if self._takes_written_weight():  # FP8AdamW writes the next one (`_written_weight`)
            set_fp8_weight_copy(weight, FP8WeightCopy(w8, sw, self.config.margin).mark_cast(weight))
            self._copy_owner = (weight,)  # a tuple: a Parameter attribute would be registered
        return w8, sw

    def forget_weight_cast(self) -> None:
        """Drop the cached FP8 weight: the next forward casts the weight as it is now. For code
        that writes `weight.data` in place (PEFT's merge) in training mode, which the cache's key
        cannot see (an eval-mode forward always casts the weight as it is)."""
        self._weight_cache = None

    def _cache_key(self) -> tuple:
        weight, scale = self.weight, self.master_scale
        return (
            _step_generation,
            weight.data_ptr(),
            weight._version,
            weight.dtype,
            weight.device,
            self.config,
            None if scale is None else (scale.data_ptr(), scale._version),
        )

    def held_weight_bytes(self) -> int:
        """Bytes of the FP8 weight this layer keeps from one optimizer step to the next forward:
        the E4M3 copy FP8-LM O2's step writes (`_takes_written_weight`), 1 B a weight; 0 where
        each forward casts the weight (a CPU, a compiled forward drops it after a step)."""
        return self.weight.numel() if self._takes_written_weight() else 0

    def _takes_written_weight(self) -> bool:
        """Whether the optimizer step may write this layer's FP8 weight: a scaled FP16 master
        (O2) under the tensorwise recipe, run eagerly on a GPU. A CPU's native optimizer kernels
        keep their speed and the forward casts; a compiled forward casts in its graph."""
        weight, config = self.weight, self.config
        return (
            self.master_scale is not None
            and weight.dtype == torch.float16
            and config.recipe.whole_tensor
            and not config.raised
            and not isinstance(weight, DTensor)
            and takes_gpu_path(weight.device)
        )

    def _written_weight(self) -> tuple[tuple, torch.Tensor, torch.Tensor] | None:
        """The cache entry of the FP8 weight the optimizer step just wrote from the master it
        stored (`optim.rules.ScaledMasterFP8`), keyed by the weight as it is now; None: none."""
        weight = self.weight
        (owner,) = getattr(self, "_copy_owner", None) or (None,)
        if owner is not None and owner is not weight:  # FSDP2's unsharded weight, a replaced one
            set_fp8_weight_copy(owner, None)
            self._copy_owner = None
        copy = get_fp8_weight_copy(weight)
        if copy is None:
            return None
        if not (copy.holds(weight) and copy.margin == self.config.margin and self._takes_written_weight()):
            set_fp8_weight_copy(weight, None)  # no optimizer wrote it: freed with the cache, as before
            return None
        return self._cache_key(), copy.payload, copy.scale

    def extra_repr(self) -> str:
        layout = ", conv1d_layout" if self.weight_transposed else ""
        master = ", scaled_fp16_master" if self.master_scale is not None else ""
        if self.weight.dtype == E4M3:
            master = ", fp8_storage"
        default = self.config.recipe is fp8_config().recipe and not self.config.raised
        recipe = "" if default else f", recipe={self.recipe}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, margin={self.margin}{recipe}{layout}{master}"
        )


def _export_real_weight(module: FP8Linear, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    # Real values of a scaled FP16 master can lie below FP16's normal range: export them in FP32.
    # FSDP2: this rank's shard with its own master scale, returned sharded like the weight.
    if module.master_scale is not None and prefix + "weight" in state_dict:
        weight = module.weight.detach()
        real = dequantize(local_shard(weight), module.master_scale, torch.float32)
        state_dict[prefix + "weight"] = sharded_like(real, weight)


def _import_real_weight(module: FP8Linear, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    key = prefix + "weight"
    if module.master_scale is None or key not in state_dict:
        return
    loaded = state_dict[key]
    real = local_shard(loaded)  # FSDP2: this rank's shard, scaled by its own amax
    # An FP8-stored weight takes the values as its forward would quantize them, a master as FP16.
    dtype, margin = (E4M3, module.margin) if module.weight.dtype == E4M3 else (torch.float16, module.master_margin)
    scale = pow2_scale(tensor_amax(real), dtype, margin).to(module.master_scale.device)
    state_dict[key] = sharded_like(quantize(real, scale, dtype), loaded)
    module.master_scale.copy_(scale)
