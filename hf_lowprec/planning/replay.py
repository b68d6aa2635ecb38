"""Replaying a pure call in the step ledger: a call of one of the package's compiled graphs (an
FP8 cast, an optimizer row) whose operations depend only on its arguments' shapes, dtypes,
layouts, aliasing and plain values. Fake tensors hold no values, so a second call with the same
`signature` adds to the ledger exactly what the first added: `CallLog` keeps that in terms that
hold for the next call, `empty_outputs` hands back outputs of the same shapes. It makes counting
a deep model's step several times faster (docs/planning.md, "Counting time").
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .operations import nbytes

__all__ = ["CallLog", "empty_outputs", "output_specs", "signature"]

PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)


class CallLog:
    """What one pure call did to a ledger (`ledger.Ledger.call_pure`), in terms that hold for another call
    with the same signature:

    - kernels as offsets from the first it opened ("in"), or the one open when it began ("open");
    - tensors as its arguments' positions ("arg"), ones it made ("new") or constants ("fixed");
    - a read's writer as one of its kernels, or whoever wrote that tensor before it began ("pre").

    `entries` is None when the call cannot be replayed; False inside an entry is a reference that
    cannot be carried to another call. `outputs`: (a tuple?, [(shape, stride, dtype, device, key)
    or None per output]); `peak`: the most its temporaries and outputs held at once."""

    def __init__(
        self, start: int = 0, opened: int | None = None, serial: int = 0, keys: tuple = (), region: Any = None
    ):
        self.start, self.opened, self.serial, self.keys, self.region = start, opened, serial, list(keys), region
        self.entries: list | None = []
        self.peak = 0
        self.end: tuple | bool | None = None
        self.outputs: tuple = (False, [None])

    def kernel_ref(self, index: int) -> tuple | bool:
        if index >= self.start:
            return ("in", index - self.start)
        return ("open",) if index == self.opened else False

    def key_ref(self, key: int) -> tuple | bool:
        if key in self.keys:
            return ("arg", self.keys.index(key))
        if key > self.serial:
            return ("new", key)
        # A tensor from before the step it was not handed (a constant table of its format): the
        # same one for every call; one made during the step and not handed in cannot be told.
        return ("fixed", key) if key < 0 else False

    def note(self, entry: tuple | None, region: Any) -> None:
        """Adds one thing the ledger did while the call ran (None: something not replayable: a
        host read, a launch count set afterwards); `region`: the compiled call running now."""
        if self.entries is None:
            return
        if entry is not None and entry[0] == "kernel":  # a region nested in the call's: not replayed
            entry = ("kernel", entry[1]) if entry[2] == region and region[1] == self.region else None
        elif entry is not None and entry[0] == "read":
            _, index, key, size, writer = entry
            # The kernel open when it began may have written the tensor before or during the call
            # (which tensors before: part of the call's state); no kernel or another earlier one
            # wrote it before (another call's tensor may have another writer: looked up then).
            before = writer is None or (writer < self.start and writer != self.opened)
            writer = ("pre",) if before else self.kernel_ref(writer)
            entry = ("read", self.kernel_ref(index), self.key_ref(key), size, writer)
        elif entry is not None and entry[0] == "write":
            _, index, key, size = entry
            entry = ("write", self.kernel_ref(index), self.key_ref(key), size)
        if entry is None or any(part is False for part in entry):
            self.entries = None
        else:
            self.entries.append(entry)


def _frozen(value: Any) -> bool:
    """A frozen dataclass instance (an FP8 scaling recipe): a plain value, compared by its fields."""
    params = getattr(type(value), "__dataclass_params__", None)
    if params is None or not params.frozen:
        return False
    try:
        hash(value)
    except TypeError:  # a field that is not a plain value
        return False
    return True


def signature(key: Any, args: tuple, kwargs: dict) -> tuple | None:
    """What a pure call's operations depend on (aliasing aside), or None where it cannot be told."""
    parts: list = [key, tuple(kwargs)]
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            if type(v) not in PLAIN:
                return None
            parts.append((v.shape, v.stride(), v.dtype, v.requires_grad))
        elif v is None or isinstance(v, (bool, int, float, str, torch.dtype)) or _frozen(v):
            parts.append((type(v), v))
        else:
            return None
    return tuple(parts)


def output_specs(out: Any, inputs: list[torch.Tensor]) -> tuple | None:
    """`CallLog.outputs` for what a pure call returned (keys unset), None unless each output is a
    tensor of its own: none of the inputs' memory, not a view, not tracked by autograd."""
    many = isinstance(out, tuple)
    outputs = list(out) if many else [out]
    made = [t for t in outputs if t is not None]
    handed = {t.untyped_storage()._cdata for t in inputs if t.layout == torch.strided}
    for t in made:
        if not isinstance(t, torch.Tensor) or type(t) not in PLAIN or t.requires_grad or t.layout != torch.strided:
            return None
        storage = t.untyped_storage()
        if storage._cdata in handed or t.storage_offset() or storage.nbytes() != nbytes(t):
            return None
    if len({t.untyped_storage()._cdata for t in made}) != len(made):
        return None
    return (many, [None if t is None else (t.shape, t.stride(), t.dtype, t.device, None) for t in outputs])


def empty_outputs(log: CallLog) -> Any:
    """Empty tensors shaped as the outputs the call `log` recorded returned (None if it returned None)."""
    many, specs = log.outputs
    made = [None if s is None else torch.empty_strided(s[0], s[1], dtype=s[2], device=s[3]) for s in specs]
    return tuple(made) if many else made[0]
