"""A CUDA device made of `FakeTensorMode` tensors, for a CPU-only torch: shapes, dtypes, devices
and the dispatcher operations of a GPU run, with no GPU and no data. On it, `fake_cuda_step`
counts a strategy's host→device copies per step and checks the FP8 GEMM path of a compute
capability.

What a CPU-only build refuses is worked around in `fake_cuda`, each patch beside its reason;
what cannot be (autograd on a CUDA tensor) is left out of the step (`fake_cuda_step`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_lowprec.planning.counting import swap_or_set_data

from .counted_step import BATCH, SEQ, checked_strategy, gpt2
from .syncs import DeviceTraffic

__all__ = ["DEVICE", "fake_cuda", "fake_cuda_step", "fp8_layer_forward_backward", "to_fake_cuda"]

DEVICE = torch.device("cuda", 0)


# `Tensor.copy_`, `Tensor.contiguous` and basic indexing (`t[:m, :n]`, `t[0]`, `t[:, None]`) go
# straight to their aten operations: their Python bindings set a CUDA device guard, which a
# CPU-only build cannot (the fake tensor never needed the device).
def _copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return torch.ops.aten.copy_.default(self, src, non_blocking)


def _contiguous(self: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    if self.is_contiguous(memory_format=memory_format):
        return self
    return torch.ops.aten.clone.default(self, memory_format=memory_format)


def _bitwise(op: Any, scalar_op: Any = None) -> Any:
    """A `Tensor` dunder for a bitwise operator (`~`, `&`, `|` and their in-place forms),
    straight to its aten operation: its Python binding sets the CUDA device guard, as `copy_`'s does."""

    def method(self: torch.Tensor, *other: Any) -> torch.Tensor:
        if not other:
            return op(self)
        (value,) = other
        return op(self, value) if isinstance(value, torch.Tensor) or scalar_op is None else scalar_op(self, value)

    return method


_BITWISE = {
    "__invert__": _bitwise(torch.ops.aten.bitwise_not.default),
    "__and__": _bitwise(torch.ops.aten.bitwise_and.Tensor, torch.ops.aten.bitwise_and.Scalar),
    "__or__": _bitwise(torch.ops.aten.bitwise_or.Tensor, torch.ops.aten.bitwise_or.Scalar),
    "__iand__": _bitwise(torch.ops.aten.bitwise_and_.Tensor, torch.ops.aten.bitwise_and_.Scalar),
    "__ior__": _bitwise(torch.ops.aten.bitwise_or_.Tensor, torch.ops.aten.bitwise_or_.Scalar),
}

_getitem = torch.Tensor.__getitem__
_tensor = torch.tensor


def _tensor_via_host(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
    """`torch.tensor(data, device=cuda)` as what it is, a host tensor copied to the device.

    The real one allocates its device tensor past the fake mode; made on the host and copied
    with `.to(device)`, it is the copy it is on a GPU (and counted as one)."""
    if device is None or torch.device(device).type != "cuda":
        return _tensor(data, *args, device=device, **kwargs)
    return _tensor(data, *args, **kwargs).to(DEVICE)


def _basic_getitem(self: torch.Tensor, key: Any) -> torch.Tensor:
    """`self[key]` for a tensor key, and keys of ints, None and step-1 slices, through aten ops;
    other keys as torch does."""
    if isinstance(key, torch.Tensor):  # a gather (a boolean key is a mask: counted as a sync)
        return torch.ops.aten.index.Tensor(self, [key])
    keys = key if isinstance(key, tuple) else (key,)
    if not all(k is None or isinstance(k, int) or (isinstance(k, slice) and k.step in (None, 1)) for k in keys):
        return _getitem(self, key)
    out, dim = self, 0
    for k in keys:
        if k is None:
            out = torch.ops.aten.unsqueeze.default(out, dim)
            dim += 1
        elif isinstance(k, int):
            out = torch.ops.aten.select.int(out, dim, k)
        else:
            start = 0 if k.start is None else k.start
            end = out.shape[dim] if k.stop is None else k.stop
            out = torch.ops.aten.slice.Tensor(out, dim, start, end)
            dim += 1
    return out


class _HostGenerator(torch.Generator):
    """A CUDA generator stand-in: draws on the host, says it is on the device (a CPU-only build
    has no CUDA generator). Fake tensors hold no values, so only the device matters."""

    def __new__(cls, device: Any = "cpu") -> _HostGenerator:
        generator = super().__new__(cls, "cpu")
        generator._device = torch.device(device)
        return generator

    def __init__(self, device: Any = "cpu") -> None:
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._device


@contextlib.contextmanager
def fake_cuda(capability: tuple[int, int]) -> Iterator[FakeTensorMode]:
    """A fake CUDA device of compute `capability`; the package's FP8 GEMM path is chosen afresh."""
    from hf_lowprec.fp8 import set_fp8_gemm_path

    set_fp8_gemm_path(None)  # forget the paths chosen for earlier (fake) devices
    with contextlib.ExitStack() as stack:
        # The package takes its CUDA branches (autocast on CUDA, the FP8 GEMM path) for the
        # capability under test.
        stack.enter_context(mock.patch("torch.cuda.is_available", return_value=True))
        stack.enter_context(mock.patch("torch.cuda.get_device_capability", return_value=capability))
        stack.enter_context(mock.patch("torch.cuda.current_device", return_value=0))
        stack.enter_context(mock.patch("torch.cuda.device_count", return_value=1))
        stack.enter_context(mock.patch("torch.cuda.is_bf16_supported", return_value=capability >= (8, 0)))
        # torch 2.11's FakeTensor makes a real tensor on the device the first time it fakes one
        # there when torch.cuda.is_available() says True (later releases ask the accelerator).
        stack.enter_context(mock.patch("torch._subclasses.fake_tensor.init_gpu_context", lambda device: None))
        stack.enter_context(mock.patch.object(torch.Tensor, "copy_", _copy_))
        stack.enter_context(mock.patch.object(torch.Tensor, "contiguous", _contiguous))
        stack.enter_context(mock.patch("torch.tensor", _tensor_via_host))
        stack.enter_context(mock.patch("torch.Generator", _HostGenerator))
        stack.enter_context(mock.patch.object(torch.Tensor, "__getitem__", _basic_getitem))
        stack.enter_context(mock.patch("torch.utils.swap_tensors", swap_or_set_data))
        for name, method in _BITWISE.items():
            stack.enter_context(mock.patch.object(torch.Tensor, name, method))
        # No device to initialise (the mode derives it from the patched is_available): otherwise
        # it propagates small constants (a 0-dim state made on the host) by running the real
        # `.to("cuda")`, which a CPU-only build cannot.
        stack.enter_context(
            mock.patch.object(FakeTensorMode, "avoid_device_init", new_callable=mock.PropertyMock, return_value=True)
        )
        stack.callback(set_fp8_gemm_path, None)
        mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        # Setup reads values too (a seed drawn with `.item()`): answered, not counted.
        stack.enter_context(DeviceTraffic(stand_in=True))
        yield mode


def to_fake_cuda(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every parameter and buffer a fake CUDA tensor (tied tensors stay tied).

    The model is built on the CPU and its tensors replaced by fake CUDA tensors of the same
    shapes and dtypes: `nn.Module.to("cuda")` needs the device guard too."""
    done: dict[int, Any] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in done:
                    fake = torch.empty_like(tensor, device=DEVICE)
                    if isinstance(tensor, torch.nn.Parameter):
                        fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
                    done[id(tensor)] = fake
                table[key] = done[id(tensor)]
    return model


class _Context:
    """What `FP8LinearFunction.setup_context`/`backward` use of an autograd context."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def fp8_layer_forward_backward(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(y, dx, dW, db) of an `FP8Linear` on `x`: its autograd function's forward and backward
    called directly, as the engine would (the forward GEMM and both backward GEMMs)."""
    from hf_lowprec.fp8.linear import FP8LinearFunction, output_dtype, quantize_layer_weight

    master = getattr(layer, "master_scale", None)
    w8, sw = quantize_layer_weight(layer.config, layer.weight, layer.weight_transposed, master)
    ctx = _Context((True, True, layer.bias is not None))
    args = (layer.config, layer.weight_transposed, output_dtype(x))
    inputs = (x, layer.weight, layer.bias, w8, sw, *args)
    outputs = FP8LinearFunction.forward(*inputs)
    FP8LinearFunction.setup_context(ctx, inputs, outputs)
    y = outputs[0]
    with torch.no_grad():  # as the engine runs a backward (grad mode on there means create_graph)
        dx, dw, db, *_ = FP8LinearFunction.backward(ctx, torch.randn_like(y))
    return y, dx, dw, db


def fake_cuda_step(name: str, capability: tuple[int, int], n_layer: int = 2, **options: Any) -> dict[str, Any]:
    """One steady training step of strategy `name` on a fake CUDA device of `capability`.

    A CPU-only build cannot record the autograd graph of a CUDA tensor (its input metadata asks
    for the device's stream and aborts the process), so the whole model does not run here. The
    pieces it can run: under the strategy's forward context, every FP8 layer's forward and backward GEMMs called directly on a batch of
    activations, then the optimizer step (the strategy's gradient processing included) on
    gradients of the parameters' shapes and dtypes, after one warm-up step (the optimizer's
    states are built there). The rest of the model's forward is not run: indexing a CUDA
    tensor (`t[:, :1]`, in transformers' mask code) sets the device in a CPU-only build. The
    autograd engine and torch's and transformers' own code are left to the real-GPU tests
    (tests/cuda, `make gpu-check`).

    Returns: {"copies": host→device copies of the steady step (`syncs.Event`s), "syncs": its host
    syncs, "gemm_path": the FP8 GEMM path chosen ("scaled_mm", "upcast", or None without
    FP8 layers), "fp8_layers": how many FP8 layers ran their GEMMs}.
    """
    from hf_lowprec.fp8 import FP8Linear, fp8_gemm_path

    with fake_cuda(capability):
        strategy = checked_strategy(name, **options)
        model = strategy.prepare_model(to_fake_cuda(gpt2(n_layer)))
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
        rows = BATCH * SEQ
        trainable = [p for p in model.parameters() if p.requires_grad]
        layers = [m for m in model.modules() if isinstance(m, FP8Linear)]

        def step() -> None:
            # Not requiring gradients during the forward: autocast's cast of a leaf that does
            # would record it (a gradient accumulator, which needs the device) even under no_grad.
            for p in trainable:
                p.requires_grad_(False)
            with torch.no_grad(), strategy.forward_context():
                for layer in layers:
                    x = torch.randn(rows, layer.in_features, device=DEVICE)
                    fp8_layer_forward_backward(layer, x)
            for p in trainable:
                p.requires_grad_(True)
                p.grad = torch.randn_like(p)
            strategy.scale_loss(torch.zeros((), device=DEVICE))  # a loss scaler starts its step here
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        with DeviceTraffic(stand_in=True) as traffic:
            step()
        return {
            "copies": traffic.copies,
            "syncs": traffic.syncs,
            "gemm_path": fp8_gemm_path(DEVICE) if layers else None,
            "fp8_layers": len(layers),
        }
