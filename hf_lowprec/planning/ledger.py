"""The step ledger: what one training step asks of a GPU, counted at the ATen dispatcher on CPU
(fake tensors carry a GPU run's shapes; `counting` drives the step on the paths a CUDA device
takes). Per phase: kernels launched, graphs called, bytes moved, GEMM FLOPs by operand dtype,
host syncs, and the peak of memory allocated. Inside a compiled region (one of the package's
graphs, or a decoder layer compiled as torch.compile would) neighbouring operations fuse into one
kernel, as Inductor fuses them: a GEMM or attention is a kernel of its own, a reduction ends the
kernel it is in, and a scalar operation on its result (a scale) joins it, as does a sibling that
reads nothing computed from it (a second amax). docs/planning.md states the model and its limits.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter, defaultdict
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..compiling import current_compiled_region
from .operations import (
    gemm_flops,
    launches_a_kernel,
    multi_tensor_launches,
    nbytes,
    tensors_in,
    written_arguments,
)
from .phases import PHASES, PhaseCounts, PhasedMode
from .replay import PLAIN, CallLog, empty_outputs, output_specs, signature

__all__ = ["PHASES", "Ledger", "PhaseCounts", "PhasedMode", "launches_a_kernel"]

aten = torch.ops.aten
_DEVICE = torch.ops.prim.device.default
_STAND_IN = {aten._local_scalar_dense.default: None, aten.is_nonzero.default: True, aten.equal.default: True}  # syncs
# Operations that reduce: a fused kernel ends with one (its result is broadcast by the next).
_REDUCTIONS = {
    "sum", "amax", "amin", "aminmax", "max", "min", "mean", "norm", "linalg_vector_norm", "var", "std",
    "var_mean", "std_mean", "any", "all", "argmax", "argmin", "prod", "_foreach_norm", "_foreach_max",
}  # fmt: skip


@dataclasses.dataclass
class _Kernel:
    phase: str
    gemm: tuple[int, torch.dtype] | None = None
    eager: bool = False
    launches: int = 1
    region: Any = None  # the compiled call it runs in (None: an eager operation)
    reduced: int = 0  # elements its first reduction reads (0: none)
    reads: dict = dataclasses.field(default_factory=dict)  # tensor key → (bytes, kernel that wrote it)
    writes: dict = dataclasses.field(default_factory=dict)  # tensor key → bytes written


class Ledger(PhasedMode):
    """Counts a step: `with Ledger() as counted:` around it, `counted.phase(name)` around its
    parts, `enter_layer`/`leave_layer` around a layer compiled as one graph; then `counted.counts()`
    ({phase: PhaseCounts}) and `counted.peak_bytes` (the most allocated at once inside it, on top
    of what existed before). Enter it inside a `FakeTensorMode`: a value the host reads (a sync)
    is counted and answered with a stand-in (1, True), so the step runs on."""

    def __init__(self, recording: bool = True, replays: dict | None = None) -> None:
        super().__init__()
        self.recording = recording  # False: only answer the host's reads (a warm-up)
        self._kernels: list[_Kernel] = []
        self._open: tuple[Any, int] | None = None  # (region, kernel index) a fused kernel is open in
        # The last kernel, when a reduction of a compiled call ended it, and what was computed from
        # its reductions (`_sibling`).
        self._ended: tuple[Any, int] | None = None
        self._after: set[int] = set()
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
        self.phase_peaks: Counter[str] = Counter()  # the peak within each phase (a model's depth scales each)
        self._refs: Counter[int] = Counter()
        self._sizes: dict[int, int] = {}
        # Pure calls (`call_pure`): {signature: what the first such call did}, shareable between
        # ledgers; `_log` collects what the call being recorded does.
        self.replays: dict = {} if replays is None else replays
        self._log: CallLog | None = None

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
            self._high(self._live)
        self._keys[id(t)] = key
        self._refs[key] += 1
        weakref.finalize(t, self._release, id(t), key)
        return key

    def _high(self, live: int) -> None:
        self.peak_bytes = max(self.peak_bytes, live)
        self.phase_peaks[self._phase] = max(self.phase_peaks[self._phase], live)

    def _release(self, ident: int, key: int) -> None:
        if self._keys.get(ident) == key:
            del self._keys[ident]
        self._refs[key] -= 1
        if self._refs[key] <= 0:
            del self._refs[key]
            self._live -= self._sizes.pop(key, 0)

    # --- dispatch -----------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and isinstance(args[0], FakeTensor):  # the commonest call: no kernel
            return args[0].fake_device  # as the fake mode answers it outside its own kernels
        kwargs = kwargs or {}
        if any(t not in PLAIN for t in types):
            # A tensor subclass (torchao's float8 tensors): its own dispatch runs first, and the
            # operations it runs on its plain inner tensors come back here to be counted.
            return NotImplemented
        if func in _STAND_IN:
            self._syncs[self._phase] += 1
            self._note(None)  # a host read: not replayed
            tensor = args[0]
            if isinstance(tensor, FakeTensor):
                stand_in = _STAND_IN[func]
                if stand_in is None:
                    return True if tensor.dtype == torch.bool else (1.0 if tensor.is_floating_point() else 1)
                return stand_in
        if func is aten._grouped_mm.default and {t.dtype for t in args[:2]} != {torch.bfloat16}:
            return self._grouped_fallback(func, args, kwargs)
        out = func(*args, **kwargs)
        if not self.recording:
            return out
        inputs = tensors_in(args) + tensors_in(kwargs.values())
        outputs = tensors_in(out if isinstance(out, (tuple, list)) else (out,))
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
        self._record(func, args, kwargs, tensors_in(args), [out])
        self._note(None)  # a launch count set after the fact: not replayed
        self._kernels[-1].launches = groups
        if self._kernels[-1].eager:
            self.ops[(self._phase, "_grouped_mm fallback mm")] += groups - 1
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, inputs: list, outputs: list) -> None:
        name = func._schema.name.split("::")[-1]
        gemm = gemm_flops(func, name, args, kwargs)
        # Inside a layer compiled as one graph, the package's own compiled calls are traced into
        # that graph (dynamo inlines them); elsewhere each is a graph of its own.
        region = self._layer[-1] if self._layer else current_compiled_region()
        if region is not None and region[1] not in self._seen_regions:
            self._seen_regions.add(region[1])
            self._graphs[self._phase] += 1
            self._note(("graph",))
        after = False  # whether what it computes is computed from the reductions of the kernel it joins
        joins = region is not None and gemm is None and self._open is not None and self._open[0] == region
        into = self._open[1] if joins else None
        if into is None and region is not None and gemm is None:
            into = self._epilogue(region, inputs, outputs)
            after = into is not None and self._ended == (region, into)  # computed from its reductions
            if into is None:
                into = self._sibling(region, inputs, outputs)
                after = into is not None and name in _REDUCTIONS
            joins = into is not None
        if joins:
            kernel = self._kernels[into]
        else:
            kernel = _Kernel(self._phase, gemm, eager=region is None, region=region)
            self._kernels.append(kernel)
            self._ended = None
            self._note(("kernel", gemm, region))
            if region is None:
                kernel.launches = multi_tensor_launches(name, args)
                self.ops[(self._phase, name)] += kernel.launches
        index = len(self._kernels) - 1 if not joins else into
        for t in inputs:
            key = self._key(t)
            if self._writer.get(key) != index:
                kernel.reads[key] = (max(kernel.reads.get(key, (0, None))[0], nbytes(t)), self._writer.get(key))
                self._note(("read", index, key, nbytes(t), self._writer.get(key)))
        written = {id(t) for t in outputs}
        for t in written_arguments(func, args, kwargs):  # in-place and out= operations
            if id(t) not in written:
                outputs.append(t)
                written.add(id(t))
        given = {id(i) for i in inputs}
        for t in outputs:
            alias = id(t) in given
            key = self._key(t) if alias else self._track(t, None)
            self._writer[key] = index
            kernel.writes[key] = max(kernel.writes.get(key, 0), nbytes(t))
            self._note(("write", index, key, nbytes(t)))
        if into is not None and (self._open is None or self._open[1] != into):
            if after:
                self._after.update(self._key(t) for t in outputs)
            return  # an epilogue or a sibling of a kernel already ended: what is open stays open
        ends = region is None or gemm is not None or name in _REDUCTIONS
        self._open = None if ends else (region, index)
        if ends and region is not None and gemm is None:
            self._ended, self._after = (region, index), {self._key(t) for t in outputs}
            kernel.reduced = max(t.numel() for t in inputs)

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

    def _sibling(self, region: Any, inputs: list, outputs: list) -> int | None:
        """The kernel an operation joins as a sibling of the reduction that ended it (Inductor
        schedules by dependence, not by the order of the source): one of the same compiled call
        that is the last kernel, that it shares a tensor with, over as many elements as that
        reduction, reading nothing computed from its reductions (`amax(m)`, then `amax(v)`: one
        kernel). None where it is not one."""
        if self._ended is None or self._ended[0] != region or not inputs:
            return None
        kernel = self._kernels[self._ended[1]]
        keys = {self._key(t) for t in inputs}
        if keys & self._after or not keys & (kernel.reads.keys() | kernel.writes.keys()):
            return None
        if any(t.numel() not in (1, kernel.reduced) for t in (*inputs, *outputs)):
            return None
        return self._ended[1]

    # --- pure calls: the first runs, a later one with the same shapes replays it ---------------

    def call_pure(self, key: Any, fn: Any, args: tuple, kwargs: dict) -> Any:
        """`fn(*args, **kwargs)` for a pure function (the source of one of the package's compiled
        graphs, `key` naming it: `compiling.call_pure`): its operations depend only on its
        arguments' shapes, dtypes, layouts, aliasing and plain values, and it returns None or
        new tensors. Fake tensors hold no values, so running it again changes nothing but the
        ledger: a call like one recorded before (in this ledger or one sharing `replays`)
        replays what that one added (kernels, reads, writes, fusion with the kernel open before
        it, its peak of temporaries) and hands back empty outputs of the same shapes, without
        running its operations. A warm-up ledger only hands back the outputs."""
        region = self._layer[-1] if self._layer else current_compiled_region()
        shapes = signature(key, args, kwargs)
        if region is None or shapes is None or self._log is not None:
            return fn(*args, **kwargs)
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        if not self.recording:  # the outputs' shapes do not depend on which arguments alias
            if shapes in self.replays:
                return empty_outputs(self.replays[shapes])
            out = fn(*args, **kwargs)
            outputs = output_specs(out, tensors)
            if outputs is not None:
                self.replays[shapes] = CallLog()
                self.replays[shapes].outputs = outputs
            return out
        keys = [self._key(t) for t in tensors]
        aliased = (*shapes, tuple(keys.index(k) for k in keys))
        self._ended = None  # a call joins no kernel ended before it as a sibling (nor after it)
        calls = self.replays.get(aliased)
        opened = self._open is not None and self._open[0] == region
        # Whether it joins the kernel open before it, which of its tensors that kernel or another
        # of its graph wrote, whether its graph has run a kernel yet: what decides how its first
        # operations fuse (into the open kernel, or as a scalar epilogue of an earlier one).
        state = (opened, tuple(self._wrote(k, region) for k in keys), region[1] in self._seen_regions)
        if calls is not None and state in calls:
            return self._replay(calls[state], keys, region)
        log = self._log = CallLog(len(self._kernels), self._open[1] if opened else None, self._serial, keys, region[1])
        live, peak, self.peak_bytes = self._live, self.peak_bytes, self._live
        try:
            out = fn(*args, **kwargs)
        finally:
            self._log, self._ended = None, None
            log.peak, self.peak_bytes = self.peak_bytes - live, max(peak, self.peak_bytes)
        log.end = None if self._open is None else log.kernel_ref(self._open[1])
        outputs = output_specs(out, tensors)
        if log.entries is not None and log.end is not False and outputs is not None:
            made = [t for t in (out if outputs[0] else [out]) if t is not None]
            keys_out = [self._key(t) for t in made]
            # Nothing it made outlives it but its outputs (a temporary kept would be missed).
            if {k for k in self._refs if k > log.serial} == set(keys_out) and all(k > log.serial for k in keys_out):
                specs = iter(keys_out)
                log.outputs = (outputs[0], [s if s is None else (*s[:4], next(specs)) for s in outputs[1]])
                self.replays.setdefault(aliased, {})[state] = log
                self.replays[shapes] = log
        return out

    def _wrote(self, key: int, region: Any) -> int:
        """2: the kernel open now wrote the tensor `key`; 3: it read it and did not write it (a
        reduction in the call may end that kernel, which then takes siblings through it); 1:
        another of `region`'s fusible kernels wrote it; 0: none did."""
        writer = self._writer.get(key)
        opened = self._open[1] if self._open is not None else None
        if opened is not None and writer != opened and key in self._kernels[opened].reads:
            return 3
        if writer is None or self._kernels[writer].region != region or self._kernels[writer].gemm:
            return 0
        return 2 if self._open is not None and writer == self._open[1] else 1

    def end_kernel(self) -> None:
        """What the compiled call runs next is a kernel of its own (`compiling.kernel_boundary`:
        the next row of a chunk of the optimizer's rows, which Inductor does not fuse with the
        one before: their sizes are distinct symbols)."""
        self._note(None)  # inside a pure call being recorded: that call is not replayed
        self._open = None
        self._ended = None

    def _note(self, entry: tuple | None) -> None:
        """Adds what `_record` did to the log of the pure call being recorded (`CallLog.note`)."""
        if self._log is not None:
            self._log.note(entry, self._layer[-1] if self._layer else current_compiled_region())

    def _replay(self, log: CallLog, keys: list[int], region: Any) -> Any:
        start, fresh = len(self._kernels), {}
        self._high(self._live + log.peak)
        out = empty_outputs(log)
        made = out if log.outputs[0] else [out]  # type: ignore[index]
        for spec, t in zip(log.outputs[1], made):  # type: ignore[index]
            if spec is not None:
                fresh[spec[-1]] = self._key(t)

        def key_of(ref: tuple) -> int:
            kind, value = ref
            if kind == "arg":
                return keys[value]
            if kind == "new":
                if value not in fresh:
                    self._serial += 1
                    fresh[value] = self._serial
                return fresh[value]
            return value

        def kernel_of(ref: tuple) -> int:
            return start + ref[1] if ref[0] == "in" else self._open[1]  # type: ignore[index]

        for entry in log.entries:  # type: ignore[union-attr]
            if entry[0] == "graph":
                self._seen_regions.add(region[1])
                self._graphs[self._phase] += 1
            elif entry[0] == "kernel":
                self._kernels.append(_Kernel(self._phase, entry[1], region=region))
            elif entry[0] == "read":
                _, at, ref, size, writer = entry
                kernel, key = self._kernels[kernel_of(at)], key_of(ref)
                writer = self._writer.get(key) if writer == ("pre",) else kernel_of(writer)
                kernel.reads[key] = (max(kernel.reads.get(key, (0, None))[0], size), writer)
            else:
                _, at, ref, size = entry
                index, key = kernel_of(at), key_of(ref)
                self._writer[key] = index
                self._kernels[index].writes[key] = max(self._kernels[index].writes.get(key, 0), size)
        self._open = None if log.end is None else (region, kernel_of(log.end))
        self._ended = None
        return out

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
