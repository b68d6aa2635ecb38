"""FP8 all-gather of FP8 linear and expert weights under FSDP2 (docs/distributed.md, "FSDP2").

`wrap_fp8_weights` wraps each FP8 weight's shard in `FP8WeightShard`, which FSDP2 all-gathers as
E4M3 (one byte per element) with the whole weight's scale, agreed over the ranks by `WeightScales`;
the gathered `FP8GatheredWeight` is the FP8 weight `linear.FP8Linear` multiplies by. Gradients are
reduce-scattered in FP32 and quantized to FP8 after (`quantize_sharded_gradients`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from .cast import scale_to_fp8
from .scaled import get_master_scale, pow2_scale, quantize, set_master_scale, tensor_amax

__all__ = [
    "FP8GatheredWeight",
    "FP8WeightShard",
    "WeightScales",
    "link_master_scales",
    "quantize_sharded_gradients",
    "wrap_fp8_weights",
]

E4M3 = torch.float8_e4m3fn
_aten = torch.ops.aten
# Views of the gathered weight (FSDP2's as_strided, nn.Parameter's detach): the payload's views.
_VIEWS = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.as_strided.default,
    _aten.slice.Tensor,
}
# Ops FSDP2 applies to the shard while it shards, pads and copies it: their results stay
# shards of the same weight (views, same-dtype copies, fresh buffers shaped like it).
_KEEP_SHARD = _VIEWS | {
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.chunk.default,
    _aten.narrow.default,
    _aten.clone.default,
    _aten.new_zeros.default,
    _aten.new_empty.default,
    _aten.empty_like.default,
    _aten.zeros_like.default,
    _aten._to_copy.default,
}


class WeightScales:
    """The E4M3 scale of every FP8 weight of one sharded model, agreed over its ranks.

    The scale s = 2^(floor(log2(448 / amax)) − margin) must be that of the whole weight, as one
    process computes it, or each rank would quantize its shard differently. Every FP8 weight's
    amax over its local shard goes into one vector, all-reduced once (MAX), which sets every
    weight's s: one all-reduce per optimizer step for all weights, run at the first all-gather
    after a step (every rank reaches it at the same point) or after a checkpoint load. The
    maximum is exact, so s and the payload equal one process's bit for bit. A scaled FP16
    master (O2) divides by its master scale as `linear.FP8Linear` does.

    `refresh` runs one all-reduce (MAX) of the local amaxes; `ensure_fresh` runs it when an
    optimizer step (the step counter of `hf_lowprec.fp8.linear`) or a load happened since.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.shards: list[FP8WeightShard] = []
        self.generation: int | None = None
        self.refreshes = 0  # all-reduces run (tests count them: one per step)

    def mark_stale(self) -> None:
        self.generation = None

    def ensure_fresh(self) -> None:
        from ..fp8 import linear

        if self.generation != linear.optimizer_step_generation():
            self.refresh()
            self.generation = linear.optimizer_step_generation()

    @torch.no_grad()
    def refresh(self) -> None:
        if not self.shards:
            return
        amax = torch.stack([s.real_amax() for s in self.shards])
        if dist.is_initialized():
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        scales = [pow2_scale(a, E4M3, s.margin) for a, s in zip(amax.unbind(), self.shards)]
        for shard, scale in zip(self.shards, scales):
            shard.box["scale"] = scale
        self.refreshes += 1


class FP8WeightShard(torch.Tensor):
    """A high-precision weight (shard) that FSDP2 all-gathers as E4M3 with its whole-tensor scale.

    FSDP2 lets the local tensor of a sharded parameter choose what is all-gathered: when it has
    `fsdp_pre_all_gather` / `fsdp_post_all_gather`, FSDP2 gathers the tensors the first returns
    and hands them to the second, which builds the unsharded parameter:

        pre-all-gather    payload = E4M3(shard · s)        one byte per element, s the weight's scale
        all-gather        the payloads (as uint8: gloo has no float8), into FSDP2's buffer
        post-all-gather   `FP8GatheredWeight(payload, s)`, which `linear.FP8Linear` uses as its
                          FP8 weight directly (no second quantization)

    `box` is shared by every view of one weight: the layer (`module`, for its master scale and
    margin), the scale (set by `WeightScales`) and the `WeightScales` of the model.
    """

    _data: torch.Tensor
    box: dict[str, Any]

    @staticmethod
    def __new__(cls, data: torch.Tensor, box: dict[str, Any]) -> FP8WeightShard:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=box.get("dtype") or data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, box: dict[str, Any]) -> None:
        self._data = data
        self.box = box

    def __repr__(self) -> str:
        return f"FP8WeightShard({self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["_data"], {"box": self.box}

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Checkpoints (torch.save, torch.distributed.checkpoint) hold the plain values: the wrapper
        # is how this process all-gathers, not part of the state.
        return self._data.detach().__reduce_ex__(protocol)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: dict, outer_size: Any, outer_stride: Any) -> FP8WeightShard:
        return FP8WeightShard(inner["_data"], meta["box"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        box = next(a.box for a in (*args, *(kwargs or {}).values()) if isinstance(a, FP8WeightShard))

        def unwrap(t: Any) -> Any:
            return t._data if isinstance(t, FP8WeightShard) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable or func not in _KEEP_SHARD:
            # In-place ops wrote into the shard's data: the shard object itself is the result.
            return args[0] if func._schema.is_mutable and isinstance(args[0], FP8WeightShard) else out
        return tree_map(lambda t: FP8WeightShard(t, box) if isinstance(t, torch.Tensor) else t, out)

    def data_ptr(self) -> int:
        # A wrapper has no storage of its own (its data_ptr is 0 for every weight): give the
        # values' address, by which Accelerate's FSDP2 path matches the optimizer's parameters
        # to the sharded ones (the Trainer's --fsdp builds the optimizer before sharding).
        return self._data.data_ptr()

    @property
    def local_values(self) -> torch.Tensor:
        """The plain tensor holding this shard's values (what the optimizer updates in place).

        A scaled FP16 master (O2) carries its layer's master scale (`get_master_scale`), also
        after FSDP2 re-made the shard's tensors at its lazy initialisation."""
        master = self.box["module"].master_scale
        if master is not None and get_master_scale(self._data) is not master:
            set_master_scale(self._data, master)
        return self._data

    @property
    def margin(self) -> int:
        return self.box["module"].margin

    def real_amax(self) -> torch.Tensor:
        """max |real weight| over this shard (a scaled master divided by its master scale)."""
        amax = tensor_amax(self._data)
        master = self.box["module"].master_scale
        return amax if master is None else amax / master

    # --- FSDP2's all-gather extension ---------------------------------------------------------
    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        self.box["scales"].ensure_fresh()
        scale = self.box["scale"]
        master = self.box["module"].master_scale
        factor = scale if master is None else scale / master
        payload = scale_to_fp8(self._data, factor, E4M3)
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads dim 0 to the same rows on every rank
        if payload.shape[0] != rows:
            padded = payload.new_zeros((rows, *payload.shape[1:]))  # zero bytes are +0.0 in E4M3
            padded[: payload.shape[0]].copy_(payload)
            payload = padded
        return (payload.view(torch.uint8),), scale

    def fsdp_post_all_gather(
        self, outputs: tuple[torch.Tensor, ...], scale: torch.Tensor, param_dtype: torch.dtype, *, out: Any = None
    ) -> Any:
        (data,) = outputs
        if out is not None:  # later steps: same buffer (FSDP2 re-allocates it in place), new scale
            out._scale = scale
            return None
        return FP8GatheredWeight(data.view(E4M3), scale, param_dtype), (data,)


class FP8GatheredWeight(torch.Tensor):
    """The all-gathered weight: its E4M3 payload and scale (real = payload / scale), dressed as a
    tensor of the parameter's dtype. `linear.FP8Linear` takes `fp8()`; any other use dequantizes."""

    _payload: torch.Tensor
    _scale: torch.Tensor

    @staticmethod
    def __new__(cls, payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> FP8GatheredWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            payload.shape,
            strides=payload.stride(),
            storage_offset=payload.storage_offset(),
            dtype=dtype,
            device=payload.device,
            requires_grad=False,
        )

    def __init__(self, payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self._payload = payload
        self._scale = scale

    def __repr__(self) -> str:
        return f"FP8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E4M3 payload, scale) as `linear.FP8Linear` uses them."""
        return self._payload, self._scale

    def dequantize(self) -> torch.Tensor:
        return (self._payload.float() / self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _VIEWS and isinstance(args[0], FP8GatheredWeight):
            this = args[0]
            return FP8GatheredWeight(func(this._payload, *args[1:], **kwargs), this._scale, this.dtype)
        unwrap = lambda t: t.dequantize() if isinstance(t, FP8GatheredWeight) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


class _ExpertWeight:
    """What an `FP8WeightShard` reads of its layer, for one 3-D weight of an FP8 experts module
    (`fp8/experts.py`): its master scale (O2), margins. The gathered weight serves every expert
    with the whole tensor's scale, as an FP8-stored expert weight does."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module, self.name = module, name

    @property
    def master_scale(self) -> torch.Tensor | None:
        return getattr(self.module, self.name + "_master_scale", None)

    @property
    def margin(self) -> int:
        return self.module.fp8_margin

    @property
    def master_margin(self) -> int:
        return getattr(self.module, "fp8_master_margin", 0)


def _fp8_weights(model: torch.nn.Module, layer_type: type) -> list[tuple[torch.nn.Module, str, Any]]:
    """(module, parameter name, owner with master_scale/margin/master_margin) of every FP8 weight:
    the `layer_type` (FP8Linear) layers' weights and the FP8 experts' 3-D weights."""
    from .experts import FP8Experts, expert_weight_names

    out: list[tuple[torch.nn.Module, str, Any]] = []
    for module in model.modules():
        if isinstance(module, layer_type):
            out.append((module, "weight", module))
        elif isinstance(module, FP8Experts):
            out += [(module, name, _ExpertWeight(module, name)) for name in expert_weight_names(module)]
    return out


def wrap_fp8_weights(model: torch.nn.Module, layer_type: type) -> WeightScales:
    """Before `fully_shard`: wrap the weight of every `layer_type` (FP8Linear) layer of `model`,
    and every 3-D weight of its FP8 experts, in `FP8WeightShard`; the returned `WeightScales`
    agrees their scales once sharded (`WeightScales.group` is set by the caller)."""
    scales = WeightScales()
    seen: set[int] = set()
    for module, name, owner in _fp8_weights(model, layer_type):
        weight = getattr(module, name)
        if id(weight) in seen:
            continue
        seen.add(id(weight))
        # A scaled FP16 master (O2) stands for FP32 real values (payload / master scale): FSDP2
        # sees FP32, the dtype of the block's other parameters (it wants one per group), and
        # reduces the gradient into FP32; the shard's storage stays the FP16 payload.
        real_dtype = torch.float32 if owner.master_scale is not None else None
        box = {"module": owner, "scale": None, "scales": scales, "dtype": real_dtype}
        shard = FP8WeightShard(weight.data, box)
        setattr(module, name, torch.nn.Parameter(shard, requires_grad=weight.requires_grad))
        if owner.master_scale is not None:  # an optimizer built from here on sees a scaled master
            set_master_scale(getattr(module, name), owner.master_scale)
    return scales


def link_master_scales(model: torch.nn.Module, layer_type: type) -> None:
    """After `fully_shard`: a scaled FP16 master (O2) becomes this rank's shard with its own
    scale, s = the FP16 power of two of the shard's amax (what FP8AdamW chooses at each step;
    the payload is multiplied by a power of two, exact), and the sharded parameter carries it
    where the optimizer reads it (`get_master_scale`; the local values carry it through
    `FP8WeightShard.local_values`). A load (`linear._import_real_weight`) scales the same way, so a
    model sharded here and one sharded then loaded hold the same bits."""
    from ..distributed import DTensor, local_shard

    for module, name, owner in _fp8_weights(model, layer_type):
        weight = getattr(module, name)
        if owner.master_scale is not None and isinstance(weight, DTensor):
            payload, master = local_shard(weight), owner.master_scale
            with torch.no_grad():
                real = payload.float() / master
                scale = pow2_scale(tensor_amax(real), payload.dtype, owner.master_margin)
                payload.copy_(quantize(real, scale, payload.dtype))  # a power of two: exact
                master.copy_(scale)
            set_master_scale(weight, master)


def collect_shards(model: torch.nn.Module, scales: WeightScales) -> None:
    """After `fully_shard`: the local shards of the wrapped weights, in module order."""
    from ..distributed import DTensor

    scales.shards = [
        p.to_local() for p in model.parameters() if isinstance(p, DTensor) and isinstance(p.to_local(), FP8WeightShard)
    ]


def quantize_sharded_gradients(
    params: Iterable[torch.Tensor], mu: torch.Tensor, dtype: torch.dtype, margin: int
) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """FP8 gradients of DTensor-sharded `params` with the scale one process would use:
    s = μ·pow2_scale(amax of the whole gradient), the amaxes of all gradients agreed in one
    all-reduce (MAX). `mu` is the scaler's 0-dim device tensor (no host read). Returns
    {id(param): (payload of the local shard, s)} and the number of saturated elements over all
    ranks (an int64 tensor, summed in a second all-reduce; nonzero only when μ > 1).

    Gradients leave the FP8 layer in BF16 (its GEMM output) and FSDP2 reduce-scatters them in FP32
    (`MixedPrecisionPolicy(reduce_dtype=fp32)`) before this runs. FSDP2's reduce-scatter takes one
    dtype and one sum for the whole bucket: FP8-LM's per-tensor scaled FP8 sum
    (`hf_lowprec.fp8.comm`) would need every tensor's scale agreed before backward ends, so the
    gradient reduction stays FP32 (docs/distributed.md says what that costs)."""
    from ..distributed import local_shard
    from .scaled import quantize_counting

    params = [p for p in params if p.grad is not None]
    if not params:
        return {}, torch.zeros((), dtype=torch.int64, device=mu.device)
    grads = [local_shard(p.grad) for p in params]
    amax = torch.stack([tensor_amax(g) for g in grads])
    group = params[0].grad.device_mesh.get_group()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scales = pow2_scale(amax, dtype, margin) * mu.to(amax.device)
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    saturated = torch.zeros((), dtype=torch.int64, device=amax.device)
    for p, g, scale in zip(params, grads, scales.unbind()):
        payload, count = quantize_counting(g, scale, dtype)
        out[id(p)] = (payload, scale)
        saturated += count
    dist.all_reduce(saturated, group=group)
    return out, saturated
