"""What makes a training step wait on the host, counted on CPU at the ATen dispatcher.

A GPU runs a step well when the host only queues kernels: no value read back (a host sync) and no
tensor sent from host memory each step (a host→device copy). `DeviceTraffic` counts both where
they happen, so CPU runs show the syncs a GPU run would make, each `Event` with the file and line
it came from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DeviceTraffic", "Event"]

HARNESS = str(Path(__file__).resolve().parent) + os.sep
# The repository this package runs from; its frames are where an event comes from.
ROOT = Path(__file__).resolve().parents[2]
_OWN_CODE = tuple(str(ROOT / d) + os.sep for d in ("hf_lowprec", "tests", "bench"))
aten = torch.ops.aten
# Operations whose result the host must read before it can go on (or whose output size depends
# on the data, which the host must read to allocate it).
_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
}
# What a fake tensor answers in place of a value it does not hold (see `DeviceTraffic`).
_SCALAR_OPS = {
    aten._local_scalar_dense.default: lambda t: (
        True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
    ),
    aten.is_nonzero.default: lambda t: True,
    aten.equal.default: lambda t: True,
}
_COPY_OPS = {aten._to_copy.default, aten.copy_.default}


def _grouped_fallback(args: tuple, kwargs: dict) -> str | None:
    """Why `aten._grouped_mm` would read its offsets on the host on a GPU, or None.

    torch's CUDA grouped GEMM has one fast kernel, BF16 operands and a BF16 output (Hopper and
    Blackwell); any other dtype runs its per-group fallback, which copies the offsets to the host
    to slice the groups. On CPU the same call reads nothing: counted here as the GPU would."""
    a, b = args[0], args[1]
    out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None)
    dtypes = {a.dtype, b.dtype, out_dtype or a.dtype}
    if dtypes == {torch.bfloat16}:
        return None
    return f"aten._grouped_mm.default ({a.dtype}, {b.dtype}: torch's per-group fallback reads the offsets on a GPU)"


@dataclasses.dataclass(frozen=True)
class Event:
    """One sync or copy: the operation and the innermost frames of the repository's code."""

    op: str
    where: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.op} at {' <- '.join(self.where) or '(no frame of this repository)'}"


def _where(depth: int = 3) -> tuple[str, ...]:
    """The innermost `depth` frames of the repository's code, else the innermost frame outside torch.

    The counting harness (this package) is never where an event comes from."""
    stack = [f for f in traceback.extract_stack() if not f.filename.startswith(HARNESS)]
    own = [f for f in stack if f.filename.startswith(_OWN_CODE)]
    if own:
        return tuple(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}" for f in reversed(own[-depth:]))
    outside = [f for f in stack if f"{os.sep}torch{os.sep}" not in f.filename]
    return tuple(f"{f.filename}:{f.lineno} {f.name}" for f in outside[-1:])


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _device(t: Any) -> str | None:
    return t.device.type if isinstance(t, torch.Tensor) else None


class DeviceTraffic(TorchDispatchMode):
    """Records the host syncs and host→device copies of everything run inside it.

    Use as `with DeviceTraffic() as counted: step()`, then read `counted.syncs`,
    `counted.copies` (lists of `Event`) or `counted.summary()`. Enter it after (inside) a
    `FakeTensorMode`, so it sees the fake CUDA tensors.

    - host syncs (`syncs`): `aten._local_scalar_dense` (`.item()`, `float(t)`, `bool(t)`, a
      tensor in an `if`), `aten.is_nonzero`, `aten.equal`, `aten.nonzero`, `aten.masked_select`,
      boolean-mask indexing (`t[mask]`: its output size is data-dependent), copies from a CUDA
      tensor to the CPU, a grouped GEMM of other operands than BF16 (on a GPU torch runs it
      group by group from offsets read on the host: `_grouped_fallback`), and `Tensor.tolist()` / `Tensor.numpy()` (invisible to the dispatcher
      on CPU, where they read memory directly: counted by wrapping them).
    - host→device copies (`copies`, meaningful on fake CUDA tensors: `fake_cuda`): `aten._to_copy`
      and `aten.copy_` from a CPU tensor of one or more elements to a CUDA one. Under
      `FakeTensorMode`, `torch.tensor(values, device="cuda")` reaches the dispatcher as
      `aten.lift_fresh` of a CPU tensor followed by `aten._to_copy` to CUDA, so it is counted
      here. A 0-dim CPU tensor handed straight to a CUDA operation is a kernel argument, not a copy.

    Each event names where it came from: the innermost frames of the repository's code
    (`hf_lowprec/`, `tests/`, `bench/`, this package excepted), so a failing test points at a
    file and line.

    Args:
        stand_in: on fake tensors, which hold no values, answer a value read by the host with
            1 (True, 1.0: "finite", "no overflow", a unit scale) instead of failing, so a step
            that still syncs runs on and its later syncs and copies are counted too.
    """

    def __init__(self, stand_in: bool = False) -> None:
        super().__init__()
        self.stand_in = stand_in
        self.syncs: list[Event] = []
        self.copies: list[Event] = []
        self._patches = contextlib.ExitStack()

    def __enter__(self) -> DeviceTraffic:
        # Dynamo refuses to run compiled code under a user dispatch mode (and the package's
        # compiled kernels would then fall back to eager for good): run every `torch.compile`d
        # function as its eager source instead, whose operations this mode then sees.
        self._patches.enter_context(torch.compiler.set_stance("force_eager"))
        super().__enter__()
        for name in ("tolist", "numpy"):
            self._patches.enter_context(_wrap_tensor_method(name, self.syncs))
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._patches.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            self.syncs.append(Event(str(func), _where()))
            if self.stand_in and func in _SCALAR_OPS and _is_fake(args[0]):
                return _SCALAR_OPS[func](args[0])
        elif func is aten.index.Tensor and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            self.syncs.append(Event("aten.index.Tensor (boolean mask)", _where()))
        elif func is aten._grouped_mm.default and (reason := _grouped_fallback(args, kwargs)) is not None:
            self.syncs.append(Event(reason, _where()))
        elif func in _COPY_OPS:
            source = args[1] if func is aten.copy_.default else args[0]
            target = _device(args[0]) if func is aten.copy_.default else str(kwargs.get("device", source.device))
            target = torch.device(target).type if target else None
            if source.device.type == "cpu" and target == "cuda" and source.numel() > 0:
                self.copies.append(Event(f"{func} host->device {tuple(source.shape)}", _where()))
            elif source.device.type == "cuda" and target == "cpu":
                self.syncs.append(Event(f"{func} device->host {tuple(source.shape)}", _where()))
        return func(*args, **kwargs)

    def summary(self, events: list[Event] | None = None) -> str:
        """One line per distinct event, most frequent first: `3× aten.… at file:line …`."""
        counts = Counter(str(e) for e in (self.syncs if events is None else events))
        return "\n".join(f"{n}x {e}" for e, n in counts.most_common())


@contextlib.contextmanager
def _wrap_tensor_method(name: str, events: list[Event]) -> Iterator[None]:
    original = getattr(torch.Tensor, name)

    def recorded(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        events.append(Event(f"Tensor.{name}", _where()))
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, recorded)
    try:
        yield
    finally:
        setattr(torch.Tensor, name, original)
