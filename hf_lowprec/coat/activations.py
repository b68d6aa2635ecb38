"""COAT's mixed-granularity FP8 activations: what layers save for backward is kept in FP8 (COAT Part 2).

`compress_activations` makes an FP8 model's non-linear layers save their input, and its MLPs the
tensors their element-wise products save, as E4M3 with one power-of-two scale per 1×16 group
(`quantize_groups`); the FP8 linear layers already save the E4M3 input their GEMM used. The rules
are docs/algorithms.md §4.
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import Any

import torch
from torch import nn

from ..compiling import in_torch_func, run_fused, takes_gpu_path
from ..fp8.convert import is_gemm_layer
from ..fp8.experts import FP8Experts
from ..fp8.linear import FP8Linear, sharing_inputs
from ..fp8.scaled import dequantize, pow2_scale, quantize, tensor_amax
from ..fp8.second_order import refusal_message, refuses_double_backward

__all__ = [
    "ACTIVATION_GROUP_SIZE",
    "compress_activations",
    "dequantize_groups",
    "quantize_groups",
    "saved_activation_bytes",
]

logger = logging.getLogger(__name__)

#: Elements per scale for non-linear layers' saved tensors (COAT: 1×16). Groups along the last
#: dimension, because one scale across tokens would hurt LayerNorm (COAT).
ACTIVATION_GROUP_SIZE = 16
_E4M3 = torch.float8_e4m3fn
_PACKABLE = (torch.float32, torch.bfloat16, torch.float16)
_ACTIVATION_MODULES = ("transformers.activations", "torch.nn.modules.activation")
_NORM_SUFFIXES = ("LayerNorm", "RMSNorm")


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 payload, int8 exponents e): real = payload / 2^e, one e per 1×16 group of the last dim
    (1 + 1/16 bytes per element).

    The scale is the power of two of `hf_lowprec.fp8.pow2_scale`, so the scaling is exact and
    only the cast rounds (relative error ≤ 2^-4 in E4M3's normal range, which spans 2^-6·448/2^8
    … 448 after scaling: elements 2^14 times below their group's maximum become subnormal).
    On a GPU one compiled graph (`run_fused`) does it, where the eager ops would launch about
    twenty small kernels per saved tensor; a CPU runs the eager ops. The same bits.
    """
    if x.dim() == 0 or x.shape[-1] % ACTIVATION_GROUP_SIZE:
        raise ValueError(
            f"the last dimension of a {tuple(x.shape)} tensor is not a multiple of {ACTIVATION_GROUP_SIZE}"
        )
    if not takes_gpu_path(x.device):
        return _quantize_groups(x)
    payload, exponent = run_fused(_quantize_groups, x.detach().reshape(-1), like=x)
    return payload.view(x.shape), exponent


def _quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = pow2_scale(tensor_amax(x, ACTIVATION_GROUP_SIZE), _E4M3)
    payload = quantize(x, scale, _E4M3, ACTIVATION_GROUP_SIZE)
    # frexp: scale = 0.5·2^(e+1) exactly, and |e| ≤ 126 fits int8.
    return payload, (torch.frexp(scale)[1] - 1).to(torch.int8)


def dequantize_groups(payload: torch.Tensor, exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of `quantize_groups`' output, in `dtype` (on a GPU one compiled graph)."""
    if not takes_gpu_path(payload.device):
        return _dequantize_groups(payload, exponent, dtype)
    return run_fused(_dequantize_groups, payload.reshape(-1), exponent, dtype, like=payload).view(payload.shape)


def _dequantize_groups(payload: torch.Tensor, exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(payload, torch.exp2(exponent.float()), dtype, ACTIVATION_GROUP_SIZE)


def _packable(t: torch.Tensor) -> bool:
    return t.dtype in _PACKABLE and t.dim() > 0 and t.shape[-1] % ACTIVATION_GROUP_SIZE == 0


def _autocast_state() -> tuple[tuple[bool, torch.dtype], tuple[bool, torch.dtype] | None]:
    """(CPU autocast on, its dtype), and the same for CUDA where there is CUDA."""
    cuda = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) if torch.cuda.is_available() else None
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")), cuda


def _forward_under(state: tuple, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's own forward under the autocast state `state` (`_autocast_state`) of its
    forward pass. Plain `with` statements: dynamo traces them (an ExitStack it cannot)."""
    (cpu_on, cpu_dtype), cuda = state
    with torch.autocast("cpu", dtype=cpu_dtype, enabled=cpu_on):
        if cuda is None:
            return type(module).forward(module, x)
        with torch.autocast("cuda", dtype=cuda[1], enabled=cuda[0]):
            return type(module).forward(module, x)


class _SavedInFP8(torch.autograd.Function):
    """y = layer(x), saving only x in 1×16 group FP8; backward re-runs the layer on the decoded x.

    The forward builds no graph. Backward differentiates the layer at the decoded input: LayerNorm
    and the GELU/SiLU/ReLU activations with torch's own backward kernels (`_kernel_backward`), any
    other layer by re-running its own forward (under the autocast state of the forward) through
    autograd, eagerly. A backward under create_graph is refused (`fp8.second_order`): the decoded
    x carries no graph.
    """

    @staticmethod
    def forward(ctx: Any, module: nn.Module, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        out = type(module).forward(module, x)
        ctx.save_for_backward(*quantize_groups(x))
        ctx.module = module
        ctx.x_dtype = x.dtype
        ctx.autocast = _autocast_state()
        ctx.out_dtype = out.dtype
        return out

    @staticmethod
    @refuses_double_backward(
        lambda ctx: refusal_message(
            f"COAT's FP8-saved activations ('coat', in a {type(ctx.module).__name__})",
            "COAT keeps this layer's input only in FP8 (1x16 groups) and its backward differentiates "
            "the layer at the decoded copy, which carries no graph",
            "precision_options={'activations': False} for this run (FP8 optimizer states, BF16 GEMMs and "
            "activations), or 'bf16-mixed'; or take the gradient without create_graph",
        )
    )
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        payload, exponent = ctx.saved_tensors
        needed = ctx.needs_input_grad[2:]
        x = dequantize_groups(payload, exponent, ctx.x_dtype)
        known = _kernel_backward(ctx.module, x, grad_out, ctx.out_dtype)
        if known is not None:
            grad_x, param_grads = known
            return (None, grad_x, *(g if need else None for g, need in zip(param_grads, needed)))
        # Any other layer (an RMSNorm, a gated MLP): its own forward again, differentiated by
        # autograd eagerly; under torch.compile by `torch.func.vjp` over the values of its
        # parameters, which dynamo traces into the backward graph (`torch.autograd.grad` it cannot:
        # a graph break per such layer). Eagerly autograd also takes layers built on old-style
        # autograd Functions (fused RMSNorm kernels), which `vjp` refuses.
        module = ctx.module
        named = list(module.named_parameters())
        wanted = [n for (n, _), need in zip(named, needed) if need]
        if not torch.compiler.is_compiling():
            x.requires_grad_(True)
            with torch.enable_grad():
                out = _forward_under(ctx.autocast, module, x)
            params = [p for n, p in named if n in wanted]
            grads = iter(torch.autograd.grad(out, [x, *params], grad_out, allow_unused=True))
        else:

            def forward(x: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
                with torch.nn.utils.stateless._reparametrize_module(module, dict(zip(wanted, values))):
                    return _forward_under(ctx.autocast, module, x)

            _, vjp = torch.func.vjp(forward, x, *(p for n, p in named if n in wanted))
            grads = iter(vjp(grad_out))
        grad_x = next(grads)
        return (None, grad_x, *(next(grads) if need else None for need in needed))


# Layers whose backward `_kernel_backward` computes with torch's own backward kernels (by class
# name for transformers' activations, which this layer does not import): GELU approximation.
_GELU_APPROXIMATION = {
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",
    "FastGELUActivation": "tanh",
    "AccurateGELUActivation": "tanh",
}


def _kernel_backward(
    module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, list[torch.Tensor | None]] | None:
    """(grad of x, grads of the module's parameters in order) of a known layer at the decoded
    input `x`, from torch's backward kernels (the ones autograd would call), computed in the
    dtype the forward ran in (`out_dtype`, which autocast may have raised); None for any other
    layer. Plain aten calls: traced by torch.compile into the backward graph, and no graph is
    built at backward time.

    transformers' tanh GELUs compute 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))) in Python; their
    derivative here is torch's tanh-GELU kernel: the same function, rounded once per element
    instead of once per Python operation."""
    g, xc = grad_out.to(out_dtype), x.to(out_dtype)
    name = type(module).__name__
    if isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward:
        w = module.weight.to(out_dtype) if module.weight is not None else None
        b = module.bias.to(out_dtype) if module.bias is not None else None
        shape = list(module.normalized_shape)
        _, mean, rstd = torch.native_layer_norm(xc, shape, w, b, module.eps)
        grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            g, xc, shape, mean, rstd, w, b, [True, w is not None, b is not None]
        )
        by_name = {"weight": grad_w, "bias": grad_b}
        param_grads = [by_name[n].to(p.dtype) for n, p in module.named_parameters(recurse=False)]
        return grad_x.to(x.dtype), param_grads
    if list(module.parameters(recurse=False)):
        return None
    if type(module) is nn.GELU or name in _GELU_APPROXIMATION:
        approximate = module.approximate if type(module) is nn.GELU else _GELU_APPROXIMATION[name]
        grad_x = torch.ops.aten.gelu_backward(g, xc, approximate=approximate)
    elif type(module) is nn.SiLU or name == "SiLUActivation":
        grad_x = torch.ops.aten.silu_backward(g, xc)
    elif type(module) is nn.ReLU:
        grad_x = torch.ops.aten.threshold_backward(g, xc, 0)
    else:
        return None
    return grad_x.to(x.dtype), []


def _layer_forward(self: nn.Module, x: Any, *args: Any, **kwargs: Any) -> Any:
    params = list(self.parameters())
    wants_grad = torch.is_tensor(x) and (x.requires_grad or any(p.requires_grad for p in params))
    # Within a torch.func transform (`grad` over `functional_call`) the layer is differentiated as
    # it is: the transform keeps what it saves, and the layer's forward reads the transform's weights.
    plain = not torch.is_grad_enabled() or not wants_grad or in_torch_func()
    if args or kwargs or plain or not _packable(x):
        return type(self).forward(self, x, *args, **kwargs)
    return _SavedInFP8.apply(self, x, *params)


def _run_in_scope(module: nn.Module, pack_activations: bool, args: tuple, kwargs: dict) -> Any:
    """Run the module's own forward where (1) FP8 layers handed the same input (q/k/v or gate/up
    projections) quantize it once and save one FP8 copy (`hf_lowprec.fp8.linear.sharing_inputs`),
    and (2) if `pack_activations`, a pack hook packs the other activations 1×16 FP8.

    (2) is for MLPs: their element-wise multiply (gated MLPs: act(gate)·up) happens in the MLP
    module's forward, not in a layer, so every floating tensor saved inside it is packed by a
    `torch.autograd.graph.saved_tensors_hooks` scope around the module."""
    if not torch.is_grad_enabled():
        return type(module).forward(module, *args, **kwargs)
    # Under torch.compile the saved-tensor hooks are not traced (dynamo breaks the graph on
    # them) and the compiled graph chooses what it saves: the scope packs in eager mode only.
    # A torch.func transform refuses saved-tensor hooks: it keeps what it saves.
    if not pack_activations or torch.compiler.is_compiling() or in_torch_func():
        with sharing_inputs():
            return type(module).forward(module, *args, **kwargs)

    # Parameters (and views of them) saved by reference cost nothing; only activations are
    # packed. A type check, not storage pointers: dynamo traces it.
    def pack(t: torch.Tensor) -> Any:
        if t.dtype == _E4M3 or not _packable(t) or isinstance(t._base if t._base is not None else t, nn.Parameter):
            return t
        return (*quantize_groups(t), t.dtype)

    def unpack(packed: Any) -> torch.Tensor:
        return dequantize_groups(*packed) if isinstance(packed, tuple) else packed

    with sharing_inputs(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return type(module).forward(module, *args, **kwargs)


def _mlp_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _run_in_scope(self, True, args, kwargs)


def _attention_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _run_in_scope(self, False, args, kwargs)


def _is_activation(module: nn.Module) -> bool:
    return type(module).__module__ in _ACTIVATION_MODULES and not list(module.children())


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(_NORM_SUFFIXES) and not list(module.children())


def _is_fp8_mlp(module: nn.Module) -> bool:
    """An MLP: it holds an activation layer directly, holds no attention (a whole block such as
    BART's layers, whose activation sits beside its attention, is not one: its scope would pack
    the attention internals), and every GEMM inside is FP8Linear (so nothing but activations is
    saved there in high precision, and its scope may pack them all)."""
    if not any(_is_activation(child) for child in module.children()):
        return False
    if any("Attention" in type(m).__name__ for m in module.modules()):
        return False
    return all(isinstance(m, FP8Linear) for m in module.modules() if is_gemm_layer(m))


def _is_fp8_attention(module: nn.Module) -> bool:
    """The innermost attention module, with FP8Linear projections."""
    if "Attention" not in type(module).__name__:
        return False
    if any("Attention" in type(m).__name__ for m in module.modules() if m is not module):
        return False
    return any(isinstance(m, FP8Linear) for m in module.modules())


def compress_activations(model: nn.Module) -> nn.Module:
    """Make `model`'s non-linear layers and gated MLPs save FP8 for backward, in place; returns `model`.

    Run `hf_lowprec.fp8.convert_to_fp8` first for the linear layers: `hf_lowprec.fp8.FP8Linear`
    already saves the E4M3 input with one per-tensor scale, the very tensor its FP8 GEMM used.
    Modules are changed in place (an instance `forward`), so parameter names, state dicts and
    `save_pretrained` are untouched; under `torch.no_grad()` (evaluation) the original forward
    runs. Attention internals (scores, softmax, the q/k/v kept by SDPA) stay in the compute
    dtype; residual adds save nothing. Modules that already have their own instance `forward`
    (another wrapper), and modules not handled, are left alone and listed once in a log line.
    """
    handled: collections.Counter[str] = collections.Counter()
    left: collections.Counter[str] = collections.Counter()
    for module in model.modules():
        name = type(module).__name__
        if "forward" in module.__dict__:
            left[f"{name} (already wrapped)"] += 1
        elif _is_activation(module) or _is_norm(module):
            module.forward = functools.partial(_layer_forward, module)
            handled[name] += 1
        elif _is_fp8_mlp(module) or isinstance(module, FP8Experts):
            # FP8 experts (fp8/experts.py): their gate products and outputs are packed the same
            # way (the routing weights, one per token, are too narrow for the groups); their
            # grouped GEMMs save E4M3 inputs and keep their scales (COAT's tensorwise recipe: one
            # per expert, last dimension 1, never packed).
            module.forward = functools.partial(_mlp_forward, module)
            handled[f"{name} (element-wise ops)"] += 1
        elif _is_fp8_attention(module):
            module.forward = functools.partial(_attention_forward, module)
            left[f"{name} (attention internals; FP8 projection inputs shared)"] += 1
        elif isinstance(module, FP8Linear):
            handled[name] += 1
        elif "Attention" in name:
            left[f"{name} (attention internals)"] += 1
        elif not list(module.children()):
            left[name] += 1
    logger.info(
        "COAT FP8 activations: handled %s; saved tensors left as they are in %s",
        _listing(handled) or "nothing",
        _listing(left) or "nothing",
    )
    return model


def _listing(counts: collections.Counter[str]) -> str:
    return ", ".join(f"{name} ×{n}" for name, n in sorted(counts.items()))


def saved_activation_bytes(forward: Any) -> tuple[Any, int]:
    """Run `forward()` and count the bytes its autograd graph keeps alive afterwards.

    Every tensor created during the call (including those packed by saved-tensor hooks and
    inside custom autograd functions) is watched through a weak reference to its storage;
    once `forward` has returned, the storages still alive are held by the graph or by the
    returned value. Parameters are not created by the forward, so they are not counted.

    Returns:
        (what `forward` returned, bytes of the distinct live storages created by it).
    """
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    # Keyed by the storage object (cdata), not its address: freed addresses are reused.
    watched: dict[int, tuple[Any, int]] = {}

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.is_view:  # an alias of a storage made earlier, or of a parameter
                return out
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    ref = StorageWeakRef(t.untyped_storage())
                    if ref.cdata not in watched or watched[ref.cdata][0].expired():
                        watched[ref.cdata] = (ref, t.untyped_storage().nbytes())
            return out

    with _Watch():
        result = forward()
    return result, sum(n for ref, n in watched.values() if not ref.expired())
