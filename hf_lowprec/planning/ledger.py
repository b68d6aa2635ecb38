"""The step ledger: what one training step asks of a GPU, counted at the ATen dispatcher on CPU
(fake tensors carry a GPU run's shapes; `counting` drives the step on the paths a CUDA device
takes). Per phase: kernels launched, graphs called, bytes moved, GEMM FLOPs by operand dtype,
host syncs, and the peak of memory allocated. Inside a compiled region (one of the package's
graphs, or a decoder layer compiled as torch.compile would) neighbouring operations fuse into one
kernel, as Inductor fuses them: a GEMM or attention is a kernel of its own, a reduction ends the
kernel it is in, and a scalar operation on its result (a scale) joins it. docs/planning.md states
the model and its limits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..compiling import current_compiled_region

__all__ = ["PHASES", "Ledger", "PhaseCounts", "PhasedMode", "launches_a_kernel"]

PHASES = ("forward", "backward", "gradients", "clip", "optimizer")

aten = torch.ops.aten
# Operations that allocate or only read metadata: no kernel runs (a view, whose output aliases
# its input without writing it, is recognised from its schema).
_NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.lift_fresh.default,
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten.is_same_size.default,
    aten._local_scalar_dense.default,  # a host sync, no kernel
    aten._unsafe_view.default,  # a view whose schema does not say so (after `reshape`'s copy)
}
_SYNCS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
_STAND_IN = {aten._local_scalar_dense.default: None, aten.is_nonzero.default: True, aten.equal.default: True}
# Operations that reduce: a fused kernel ends with one (its result is broadcast by the next).
_REDUCTIONS = {
    "sum", "amax", "amin", "aminmax", "max", "min", "mean", "norm", "linalg_vector_norm", "var", "std",
    "var_mean", "std_mean", "any", "all", "argmax", "argmin", "prod", "_foreach_norm", "_foreach_max",
}  # fmt: skip
_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)
_ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm"}


def launches_a_kernel(func: Any) -> bool:
    """Whether an ATen operation runs a kernel on a GPU (not a view, an allocation or a metadata read)."""
    if func in _NO_KERNEL or func.namespace in ("profiler", "prim"):  # markers, `prim::device`
        return False
    returns = func._schema.returns
    # A view: every output aliases an input and nothing is written.
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))


def _argument(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """The argument `name` of a call of `func`, read from its schema (positional or keyword)."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[position] if position < len(args) else kwargs.get(name, default)
    return default


def _gemm_flops(func: Any, name: str, args: tuple, kwargs: dict) -> tuple[int, torch.dtype] | None:
    """(FLOPs, operand dtype) of a GEMM or attention operation, None for any other."""
    if name in _GEMMS:
        a = args[1] if name in ("addmm", "baddbmm") else args[0]
        b = args[2] if name in ("addmm", "baddbmm") else args[1]
        # Every row of a (groups stacked or not) meets one K×N matrix of b: 2·rows·K·N.
        return 2 * (a.numel() // a.shape[-1]) * a.shape[-1] * b.shape[-1], a.dtype
    if any(name.startswith(p) for p in _ATTENTION):
        q, k = _argument(func, args, kwargs, "query"), _argument(func, args, kwargs, "key")
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or not isinstance(k, torch.Tensor):
            return None
        batch, heads, rows, dim = q.shape
        # Causal attention (what a decoder trains): the fused kernels skip the masked half.
        causal = 0.5 if _argument(func, args, kwargs, "is_causal", False) is True else 1.0
        flops = 4 * batch * heads * rows * k.shape[-2] * dim * causal
        return int(flops * (2.5 if name.endswith("backward") else 1.0)), q.dtype
    return None


@dataclasses.dataclass
class PhaseCounts:
    """One phase's counts: `kernels` launched (eager operations, plus each compiled call's fused
    kernels), `graphs` (compiled calls), `eager` (operations run one by one), `bytes` read and
    written, GEMM `flops` by operand dtype, the share of `bytes` in GEMM kernels, `syncs`, and
    `gemm_kernels` (FLOPs and bytes per GEMM kernel, for the roofline)."""

    kernels: int = 0
    graphs: int = 0
    eager: int = 0
    bytes: int = 0
    syncs: int = 0
    flops: Counter = dataclasses.field(default_factory=Counter)
    gemm_kernels: list = dataclasses.field(default_factory=list)

    def add(self, other: PhaseCounts, times: float = 1.0) -> None:
        self.kernels += round(other.kernels * times)
        self.graphs += round(other.graphs * times)
        self.eager += round(other.eager * times)
        self.bytes += round(other.bytes * times)
        self.syncs += round(other.syncs * times)
        for dtype, n in other.flops.items():
            self.flops[dtype] += round(n * times)
        self.gemm_kernels += [(dtype, f * times, b * times) for dtype, f, b in other.gemm_kernels]


@dataclasses.dataclass
class _Kernel:
    phase: str
    gemm: tuple[int, torch.dtype] | None = None
    eager: bool = False
    launches: int = 1
    region: Any = None  # the compiled call it runs in (None: an eager operation)
    reads: dict = dataclasses.field(default_factory=dict)  # tensor key → (bytes, kernel that wrote it)
    writes: dict = dataclasses.field(default_factory=dict)  # tensor key → bytes written


class PhasedMode(TorchDispatchMode):
    """A dispatch mode that counts per phase (`with mode.phase(name):`) and runs every
    `torch.compile`d function as its eager source while it is on (dynamo refuses to run under a
    dispatch mode), so it sees each operation; the package marks its own compiled calls."""

    def __init__(self) -> None:
        super().__init__()
        self._phase = "step"
        self._patches = contextlib.ExitStack()

    def __enter__(self) -> PhasedMode:
        self._patches.enter_context(torch.compiler.set_stance("force_eager"))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._patches.close()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous


class Ledger(PhasedMode):
    """Counts a step: `with Ledger() as counted:` around it, `counted.phase(name)` around its
    parts, `enter_layer`/`leave_layer` around a layer compiled as one graph; then `counted.counts()`
    ({phase: PhaseCounts}) and `counted.peak_bytes` (the most allocated at once inside it, on top
    of what existed before). Enter it inside a `FakeTensorMode`: a value the host reads (a sync)
    is counted and answered with a stand-in (1, True), so the step runs on."""

    def __init__(self, recording: bool = True) -> None:
        super().__init__()
        self.recording = recording  # False: only answer the host's reads (a warm-up)
        self._kernels: list[_Kernel] = []
        self._open: tuple[Any, int] | None = None  # (region, kernel index) a fused kernel is open in
        self._writer: dict[int, int] = {}  # tensor key → the kernel that last wrote it
        self._keys: dict[int, int] = {}  # id(tensor) → key of its memory (a view: its base's)
        self._serial = 0
        self._layer: list[tuple[str, int]] = []
        self._graphs: Counter[str] = Counter()
        self._seen_regions: set = set()
        self._syncs: Counter[str] = Counter()
        self.ops: Counter[tuple[str, str]] = Counter()  # (phase, operation) of each eager kernel
        self._live = 0
        self.peak_bytes = 0
        self._refs: Counter[int] = Counter()
        self._sizes: dict[int, int] = {}

    def enter_layer(self, name: str) -> None:
        """From here to `leave_layer`, operations run as one compiled graph of torch's own (a
        decoder layer under regional compilation)."""
        self._serial += 1
        self._layer.append((name, -self._serial))

    def leave_layer(self) -> None:
        if self._layer:
            self._layer.pop()

    # --- tensors: memory keys, liveness -----------------------------------------------------

    def _key(self, t: torch.Tensor) -> int:
        return self._keys.get(id(t), -id(t))  # a tensor from before the step: its own key

    def _track(self, t: torch.Tensor, key: int | None) -> int:
        """Registers an output: a fresh allocation when `key` is None, else a view of `key`."""
        if id(t) in self._keys:
            return self._keys[id(t)]
        if key is None:
            self._serial += 1
            key = self._serial
            size = t.untyped_storage().nbytes() if t.layout == torch.strided else 0
            self._sizes[key] = size
            self._live += size
            self.peak_bytes = max(self.peak_bytes, self._live)
        self._keys[id(t)] = key
        self._refs[key] += 1
        weakref.finalize(t, self._release, id(t), key)
        return key

    def _release(self, ident: int, key: int) -> None:
        if self._keys.get(ident) == key:
            del self._keys[ident]
        self._refs[key] -= 1
        if self._refs[key] <= 0:
            del self._refs[key]
            self._live -= self._sizes.pop(key, 0)

    # --- dispatch -----------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t not in _PLAIN for t in types):
            # A tensor subclass (torchao's float8 tensors): its own dispatch runs first, and the
            # operations it runs on its plain inner tensors come back here to be counted.
            return NotImplemented
        if func in _SYNCS:
            self._syncs[self._phase] += 1
            tensor = args[0]
            if _is_fake(tensor):
                stand_in = _STAND_IN[func]
                if stand_in is None:
                    return True if tensor.dtype == torch.bool else (1.0 if tensor.is_floating_point() else 1)
                return stand_in
        if func is aten._grouped_mm.default and {t.dtype for t in args[:2]} != {torch.bfloat16}:
            return self._grouped_fallback(func, args, kwargs)
        out = func(*args, **kwargs)
        if not self.recording:
            return out
        inputs = _tensors(args) + _tensors(kwargs.values())
        outputs = _tensors(out if isinstance(out, (tuple, list)) else (out,))
        if not launches_a_kernel(func):
            base = self._key(inputs[0]) if inputs else None
            for t in outputs:
                self._track(
                    t,
                    base
                    if func._schema.returns and any(r.alias_info is not None for r in func._schema.returns)
                    else None,
                )
            return out
        self._record(func, args, kwargs, inputs, outputs)
        return out

    def _grouped_fallback(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """A grouped GEMM whose operands are not BF16, as torch runs it on a GPU: the offsets read
        on the host (a sync), then one GEMM per group (torch's fake kernel refuses these dtypes:
        the shape comes from its BF16 form)."""
        self._syncs[self._phase] += 1
        a, b, *rest = args
        out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kwargs).to(a.dtype)
        if not self.recording:
            return out
        offsets = rest[0] if rest else kwargs.get("offs")
        groups = offsets.numel() if isinstance(offsets, torch.Tensor) else 1
        self._record(func, args, kwargs, _tensors(args), [out])
        self._kernels[-1].launches = groups
        if self._kernels[-1].eager:
            self.ops[(self._phase, "_grouped_mm fallback mm")] += groups - 1
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, inputs: list, outputs: list) -> None:
        name = func._schema.name.split("::")[-1]
        gemm = _gemm_flops(func, name, args, kwargs)
        # Inside a layer compiled as one graph, the package's own compiled calls are traced into
        # that graph (dynamo inlines them); elsewhere each is a graph of its own.
        region = self._layer[-1] if self._layer else current_compiled_region()
        if region is not None and region[1] not in self._seen_regions:
            self._seen_regions.add(region[1])
            self._graphs[self._phase] += 1
        joins = region is not None and gemm is None and self._open is not None and self._open[0] == region
        into = self._open[1] if joins else None
        if into is None and region is not None and gemm is None:
            into = self._epilogue(region, inputs, outputs)
            joins = into is not None
        if joins:
            kernel = self._kernels[into]
        else:
            kernel = _Kernel(self._phase, gemm, eager=region is None, region=region)
            self._kernels.append(kernel)
            if region is None:
                kernel.launches = _multi_tensor_launches(name, args)
                self.ops[(self._phase, name)] += kernel.launches
        index = len(self._kernels) - 1 if not joins else into
        for t in inputs:
            key = self._key(t)
            if self._writer.get(key) != index:
                kernel.reads[key] = (max(kernel.reads.get(key, (0, None))[0], _nbytes(t)), self._writer.get(key))
        written = {id(t) for t in outputs}
        for t in _written_arguments(func, args, kwargs):  # in-place and out= operations
            if id(t) not in written:
                outputs.append(t)
                written.add(id(t))
        given = {id(i) for i in inputs}
        for t in outputs:
            alias = id(t) in given
            key = self._key(t) if alias else self._track(t, None)
            self._writer[key] = index
            kernel.writes[key] = max(kernel.writes.get(key, 0), _nbytes(t))
        if into is not None and (self._open is None or self._open[1] != into):
            return  # an epilogue of a kernel already ended: what is open stays open
        ends = region is None or gemm is not None or name in _REDUCTIONS
        self._open = None if ends else (region, index)

    def _epilogue(self, region: Any, inputs: list, outputs: list) -> int | None:
        """The kernel a scalar operation (every tensor it reads and writes one element: a scale,
        its reciprocal) fuses into after a reduction ended the kernel it would have joined: the
        last one of the same compiled call that wrote one of its inputs, as Inductor fuses a
        reduction's scalar epilogue; None where no such kernel wrote its inputs."""
        if not inputs or any(t.numel() != 1 for t in (*inputs, *outputs)):
            return None
        writers = [self._writer.get(self._key(t)) for t in inputs]
        found = [
            w for w in writers if w is not None and self._kernels[w].region == region and not self._kernels[w].gemm
        ]
        return max(found) if found else None

    def counts(self) -> dict[str, PhaseCounts]:
        """{phase: PhaseCounts} of what ran inside. Bytes as a compiler moves them: within one
        compiled call, what one fused kernel computes and another reads is recomputed or kept
        on chip, not written and read again, unless a GEMM or attention kernel reads it or
        writes it (those take their operands from memory); a tensor is written when a kernel
        outside its call reads it, or it outlives the step; an eager operation writes its outputs."""
        kernels = self._kernels

        def fused(a: int | None, b: int) -> bool:  # a tensor passed between them stays on chip
            if a is None:
                return False
            first, second = kernels[a], kernels[b]
            return first.region is not None and first.region == second.region and not (first.gemm or second.gemm)

        readers: dict[tuple[int, int], list[int]] = defaultdict(list)  # (writer, key) → readers
        for index, kernel in enumerate(kernels):
            for key, (_, writer) in kernel.reads.items():
                if writer is not None:
                    readers[(writer, key)].append(index)
        result = {phase: PhaseCounts() for phase in (*PHASES, "step")}
        for index, kernel in enumerate(kernels):
            counts = result.setdefault(kernel.phase, PhaseCounts())
            counts.kernels += kernel.launches
            counts.eager += kernel.launches if kernel.eager else 0
            read = sum(b for b, writer in kernel.reads.values() if not fused(writer, index))
            written = 0
            for key, b in kernel.writes.items():
                later = [r for r in readers[(index, key)] if r != index]
                outlives = key < 0 or key in self._refs  # a tensor from before, or alive after
                if kernel.region is None or any(not fused(index, r) for r in later) or (not later and outlives):
                    written += b
            moved = read + written
            counts.bytes += moved
            if kernel.gemm is not None:
                flops, dtype = kernel.gemm
                counts.flops[dtype] += flops
                counts.gemm_kernels.append((dtype, flops, moved))
        for phase, n in self._graphs.items():
            result.setdefault(phase, PhaseCounts()).graphs += n
        for phase, n in self._syncs.items():
            result.setdefault(phase, PhaseCounts()).syncs += n
        return {phase: c for phase, c in result.items() if c.kernels or c.syncs or phase in PHASES}


# torch's multi-tensor kernels (`_foreach_*`, the fused optimizers) launch one kernel per chunk:
# at most 110, 64, 48, 36 or 30 tensors when they walk 1 to 5 lists at once, and at most 320
# blocks of 65536 elements (`MultiTensorApply.cuh`).
_TENSORS_PER_LAUNCH, _ELEMENTS_PER_LAUNCH = (110, 64, 48, 36, 30), 320 * 65536


def _multi_tensor_launches(name: str, args: tuple) -> int:
    if not name.startswith(("_foreach_", "_fused_")):
        return 1
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    # A list of 0-dim tensors (a fused optimizer's step counts) rides along as kernel arguments.
    lists = [a for a in lists if a[0].dim() > 0] or lists[:1]
    if not lists:
        return 1
    per_launch = _TENSORS_PER_LAUNCH[min(len(lists), len(_TENSORS_PER_LAUNCH)) - 1]
    elements = sum(t.numel() for t in lists[0])
    return max(1, -(-len(lists[0]) // per_launch), -(-elements // _ELEMENTS_PER_LAUNCH))


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _tensors(values: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found += [t for t in v if isinstance(t, torch.Tensor)]
    return found


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size() if t.layout == torch.strided else 0


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operation writes in place (its schema's `Tensor(a!)` arguments)."""
    found: list[torch.Tensor] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        found += _tensors([value])
    return found
