"""Which implementation runs an optimizer step, one dispatch for every AdamW family (`run_bucket`):
the family's pure step function run eagerly (the reference, `adamw.Composition.step`), the same
function compiled by `torch.compile` (vectorised C++/OpenMP on CPU, Triton on CUDA), or on CPU the
native kernels (`native_dispatch`). On CPU all three give the same bits; on CUDA, Triton may
contract a·b + c into an FMA, and the results agree within one rounding of each FP32 intermediate.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
import torch._inductor.config

from ..compiling import (
    LARGE_ROW,
    call_pure,
    chunks_of,
    compiled_region,
    compiler_missing,
    kernel_boundary,
    one_graph_for_every_size,
    raised_at,
    takes_gpu_path,
)

__all__ = [
    "COMPILE_OPTIONS",
    "FUSED_MODES",
    "PARALLEL_MIN_NUMEL",
    "FusedMode",
    "ParamStep",
    "check_fused_mode",
    "combo_rows",
    "run_bucket",
]

logger = logging.getLogger(__name__)

FusedMode = Literal["auto", "native", "compiled", "reference", "foreach"]
FUSED_MODES: tuple[str, ...] = ("auto", "native", "compiled", "reference")

# The compiled step gives the reference's bits on CPU: Inductor keeps the explicit casts
# (emulate_precision_casts; the roundings to the parameter's dtype inside a step, `formats.round_to`,
# are integer operations when compiled, since torch 2.11's Inductor drops an FP32 → BF16 → FP32
# round trip), does not contract a·b + c into an FMA (its C++ is built with -ffp-contract=off), and
# roots are correctly rounded on both sides (`formats.root`). cpp.dynamic_threads always opens the
# OpenMP region (otherwise the size hint of the first, possibly tiny, tensor would leave the graph
# single-threaded); tensors below PARALLEL_MIN_NUMEL take a single-threaded build. coalesce_tiling_analysis
# (Triton only: how a fused kernel is tiled, never what it computes) is off: Inductor documents it
# as not applying to dynamic shapes, and in torch 2.11 it asserts on a group format's graph
# (`tiling_utils.get_pw_red_splits` compares the size symbols of a per-group tensor and of the
# (groups × block) view structurally, before the guard that makes them equal is applied: an
# empty AssertionError, pytorch/pytorch#181563), so COAT's step fell back to the reference on CUDA.
COMPILE_OPTIONS = {
    "emulate_precision_casts": True,
    "cpp.dynamic_threads": True,
    "triton.coalesce_tiling_analysis": False,
}
PARALLEL_MIN_NUMEL = 32768
# No combo kernels on CUDA: they share one block size among the rows of a kernel, reductions
# included, and the step ran at half to a tenth of torch's fused AdamW's pace with them (an H200,
# 2026-12-04). The rows are stepped in chunks (`compiling.chunks_of`). `combo_rows()` builds the
# graphs over rows with pointwise combo kernels, each row with block sizes of its own where this
# Inductor has the options (a chunk of eight AdamW rows: one launch, not eight); the device check's
# `optim` section times it beside the default, so that a GPU decides between the two.
_COMBO_OPTIONS = {
    name: True
    for name in ("combo_kernels", "combo_kernels_pointwise_only", "combo_kernel_per_subkernel_blocks")
    if hasattr(torch._inductor.config, name)
}
_combo = False
# One graph per (family, dtypes, device): a process that trains several strategies needs more
# than dynamo's default of 8 recompiles before it would give up on the function.
_RECOMPILE_LIMIT = 64

_logged: set[str] = set()
_broken: set[tuple[object, str]] = set()


def check_fused_mode(owner: str, fused: str) -> str:
    """The mode `fused` names ("foreach", deprecated, is read as "reference"); raise naming the valid
    ones, or for "auto"/"native" a bad `HF_LOWPREC_CPU_ISA` (`native.forced_isa`)."""
    if fused == "foreach":
        warnings.warn(
            f"{owner}: fused='foreach' is deprecated: it is the old name of the eager reference step; "
            "pass fused='reference'",
            DeprecationWarning,
            stacklevel=3,
        )
        return "reference"
    if fused not in FUSED_MODES:
        raise ValueError(
            f"{owner}: unknown fused={fused!r}; choose 'auto' (the fastest path that runs), "
            f"'native' or 'compiled' (require that path) or 'reference' (the eager reference)"
        )
    if fused in ("auto", "native"):
        from .native import forced_isa  # imported where used, as `_run_native` does; builds nothing

        # The kernels read the variable at the first step, after a forward and backward: check it now.
        forced_isa()
    return fused


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


@dataclasses.dataclass
class ParamStep:
    """One parameter's share of a step: its tensors in the order the step function takes them.

    `like_param[i]` says whether `tensors[i]` has the parameter's elements (it is flattened, padded
    to whole blocks or staged like the parameter) or is stored as it is (scales, block metadata,
    payloads already padded).
    """

    tensors: list[torch.Tensor | None]
    like_param: Sequence[bool]
    scalars: torch.Tensor
    seed: torch.Tensor | None
    #: The step's found-inf flag (0-dim, the parameter's device; nonzero: leave every tensor as it was).
    found_inf: torch.Tensor | None = None


def _stage(row: ParamStep, block: int) -> tuple[list[torch.Tensor | None], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The row's tensors as the step function takes them, and the (original, copy) pairs to write back."""
    return _stage_tensors(row.tensors, row.like_param, block)


def _stage_tensors(
    tensors: Sequence[torch.Tensor | None], like: Sequence[bool], block: int
) -> tuple[list[torch.Tensor | None], list[tuple[torch.Tensor, torch.Tensor]]]:
    """`_stage` of a row's tensors; traceable, so a GPU's graph over a chunk of rows stages inside it."""
    numel = tensors[0].numel()
    padded = -(-numel // block) * block
    staged: list[torch.Tensor | None] = []
    write_back = []
    for tensor, like_param in zip(tensors, like):
        if tensor is None or not like_param:
            staged.append(tensor)
            continue
        tensor = tensor.detach()
        if padded == numel and tensor.is_contiguous():
            flat = tensor.view(-1)
        else:
            flat = torch.nn.functional.pad(tensor.reshape(-1), (0, padded - numel))  # zeros after the elements
            write_back.append((tensor, flat))
        staged.append(flat if block == 1 else flat.view(-1, block))
    return staged, write_back


def _unstage(write_back: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for original, flat in write_back:
        original.copy_(flat[: original.numel()].view(original.shape))


def _why_not_compiled(key: object, device: torch.device) -> str | None:
    reason = compiler_missing(device.type)
    if reason is None and (key, device.type) in _broken:
        reason = "compiling it failed earlier in this process"
    return reason


def run_bucket(
    key: object,
    function: Callable[..., torch.Tensor],
    block: int,
    rows: Sequence[ParamStep],
    mode: str,
    *,
    want_updates: bool,
    counter: collections.Counter | None = None,
) -> list[torch.Tensor] | None:
    """Run `function(*tensors, scalars, seed, found_inf=...)` on every row, as `mode` says.

    Modes (the optimizers' `fused` option; "foreach", the old name of "reference", is accepted
    with a DeprecationWarning):

    - "reference": the eager function, always;
    - "compiled": the compiled function, or a RuntimeError naming why it cannot run;
    - "native": the native kernel, or a RuntimeError naming why it cannot run;
    - "auto": on CPU the native kernel where the family has one (bit-identical to the reference,
      and the fastest path on the CPUs measured: docs/benchmarks.md), else the compiled function
      (CPU with a C++ compiler, CUDA with Triton), else the reference, each fallback's reason
      logged once. A compile failure marks the kernel broken for the process.

    Layout: one call per parameter, its tensors flat (or as (blocks × block) views for block
    formats, the block a static dimension so the loops vectorise), dynamic shapes, so one compiled
    graph serves every parameter of a dtype combination. A parameter that is not contiguous, or
    whose size is not a multiple of the block, runs on contiguous zero-padded copies that are
    copied back (every path; zeros stay zero in every format). On a GPU the rows are stepped a
    chunk at a time, each chunk one compiled call over its rows unrolled (`chunks_of`).

    Args:
        key: names the function for logs and the broken-kernel set (its composition).
        function: the pure step; returns Δθ (FP32), which the compiled path discards.
        block: elements per block of the formats (1 for element-wise ones).
        want_updates: return each row's Δθ (tracked steps): always the reference, which has the
            same bits as the other paths but also hands Δθ back.
        counter: receives one count per row under the path that ran ("native", "compiled" or
            "reference": the optimizers' `paths_taken`, so tests and users see what ran).
    Returns:
        The updates Δθ (FP32, in the staged layout) when `want_updates`, else None.
    """
    if not rows:
        return [] if want_updates else None
    device = rows[0].tensors[0].device
    if mode in ("auto", "native") and not want_updates and _run_native(key, rows, mode, counter):
        return None
    compiled = mode in ("auto", "compiled") and not want_updates
    if compiled:
        reason = _why_not_compiled(key, device)
        if reason is not None:
            if mode == "compiled":
                raise RuntimeError(
                    f"fused='compiled' but the compiled step of {key} cannot run on {device.type}: {reason}; "
                    f"use fused='auto' (falls back to the reference) or fused='reference'"
                )
            _log_once(logging.WARNING, f"optimizer step: {reason}; running the reference of {key}")
            compiled = False
    if compiled:
        _log_once(logging.INFO, f"optimizer step: compiled {key} on {device.type}")
        rows = _run_compiled(key, function, block, rows, mode, device, counter)
        if not rows:
            return None
    updates = []
    for row in rows:
        staged, write_back = _stage(row, block)
        delta = function(*staged, row.scalars, row.seed, found_inf=row.found_inf)
        _unstage(write_back)
        if want_updates:
            updates.append(delta)
        if counter is not None:
            counter["reference"] += 1
    return updates if want_updates else None


def _run_native(key: object, rows: Sequence[ParamStep], mode: str, counter: collections.Counter | None) -> bool:
    """Step the bucket with the native kernel; False (nothing changed) when it cannot run it."""
    from .native_dispatch import native_call, unsupported

    reason = "not a CPU tensor" if takes_gpu_path(rows[0].tensors[0].device) else unsupported(key, rows[0])
    if reason is not None:
        if mode == "native":
            raise RuntimeError(
                f"fused='native' but the native kernels cannot run {key}: {reason}; "
                f"use fused='auto' (falls back to the compiled step) or fused='compiled'"
            )
        _log_once(logging.INFO, f"optimizer step: no native kernel ({reason}); trying the compiled step of {key}")
        return False
    staged = [_stage(row, 1) for row in rows]
    flat_rows = [
        ParamStep(tensors, row.like_param, row.scalars, row.seed, row.found_inf)
        for (tensors, _), row in zip(staged, rows)
    ]
    _log_once(logging.INFO, f"optimizer step: native {key}")
    native_call(key, flat_rows)()
    for _, write_back in staged:
        _unstage(write_back)
    if counter is not None:
        counter["native"] += len(rows)
    return True


def _run_compiled(key, function, block, rows, mode, device, counter) -> Sequence[ParamStep]:
    """Step the rows with the compiled function; returns those it could not step (a failed build)."""

    def discard(*args: torch.Tensor | None, found_inf: torch.Tensor | None = None) -> None:
        function(*args, found_inf=found_inf)

    discard.__name__ = discard.__qualname__ = f"step_{abs(hash(key))}"
    if takes_gpu_path(device) and (key, "rows") not in _broken:
        left = _run_compiled_together(key, discard, block, rows)
        if counter is not None:
            counter["compiled"] += len(rows) - len(left)
        if not left:
            return left
        rows = left
    with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT), one_graph_for_every_size():
        for index, row in enumerate(rows):
            staged, write_back = _stage(row, block)
            if block > 1:
                for tensor in staged:
                    if tensor is not None and tensor.dim() == 2:
                        torch._dynamo.mark_static(tensor, 1)
            parallel = row.tensors[0].numel() >= PARALLEL_MIN_NUMEL
            try:
                with compiled_region(discard.__name__):
                    _compiled_for(key, discard, parallel)(*staged, row.scalars, row.seed, **_flag(row))
            except Exception as error:  # a backend failure: fall back in "auto", never lose a step
                if mode == "compiled" or index:
                    # After the first row the graph is built: a later failure is not a
                    # compile problem, and the rows before it have already stepped.
                    raise
                _broken.add((key, device.type))
                _log_once(
                    logging.WARNING,
                    f"compiling {key} failed ({type(error).__name__}: {error}{raised_at(error)}); using the reference",
                )
                return rows
            _unstage(write_back)
            if counter is not None:
                counter["compiled"] += 1
    return []


def _run_compiled_together(key, discard, block, rows) -> list[ParamStep]:
    """A GPU's step: the bucket's rows in a few compiled calls over chunks of rows unrolled, within
    groups a graph serves whole (`chunks_of`, `_group_of`): a few graphs per composition whatever
    the model, the same per-row function as `_run_compiled` (the same bits). Returns the rows not
    stepped: none, or those from a chunk whose graph failed to build on (the per-row graphs then)."""
    groups: dict[tuple, list[ParamStep]] = {}
    for row in rows:
        groups.setdefault(_group_of(row, block), []).append(row)
    name, order, done = f"{discard.__name__}_rows", [row for group in groups.values() for row in group], 0
    try:
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT), one_graph_for_every_size():
            for (*_, large), group in groups.items():
                graph = _graph_over_rows(key, discard, block, name, large)
                rows_args, flags = _rows_args(group, block), [_flag(row)["found_inf"] for row in group]
                for chunk in chunks_of(len(group)):
                    with compiled_region(name):
                        graph(rows_args[chunk], flags[chunk])
                    done += chunk.stop - chunk.start
    except Exception as error:  # a backend failure: the per-row graphs step the rest
        _broken.add((key, "rows"))
        _log_once(
            logging.WARNING,
            f"compiling {key} over rows failed ({type(error).__name__}: {error}{raised_at(error)}); "
            "stepping it one row at a time",
        )
    return order[done:]


def _group_of(row: ParamStep, block: int) -> tuple:
    """What a graph over rows guards on (staged or not: `_stage_tensors`; each tensor's rank and
    dtype) and the size class, which has graphs of its own: Inductor splits a whole-tensor reduction
    by the size it built for, and a graph built on a bias would reduce a large weight in one block."""
    numel, like = row.tensors[0].numel(), zip(row.tensors, row.like_param)
    staged = numel % block != 0 or not all(t.is_contiguous() for t, is_like in like if t is not None and is_like)
    return staged, tuple(t if t is None else (t.dim(), t.dtype) for t in row.tensors), numel >= LARGE_ROW


def _rows_args(rows: Sequence[ParamStep], block: int) -> list[tuple]:
    rows_args = []
    for row in rows:
        tensors = [t.detach() if t is not None and like else t for t, like in zip(row.tensors, row.like_param)]
        if block > 1:
            for tensor, like in zip(tensors, row.like_param):
                if tensor is not None and not like and tensor.dim() == 2:
                    torch._dynamo.mark_static(tensor, 1)
        rows_args.append((tensors, tuple(row.like_param), row.scalars, row.seed))
    return rows_args


def _graph_over_rows(key, discard, block: int, name: str, large: bool) -> Callable[..., object]:
    """The compiled callable stepping a chunk of rows (one per composition, block and size class)."""
    index = (key, name, block, _combo, large)  # `block`, a constant of the graph
    if index in _graphs:
        return _graphs[index]

    def together(rows_args: list[tuple], flags: list[torch.Tensor]) -> None:
        # Staging (a zero-padded copy of a parameter that is not whole blocks, or not contiguous)
        # and its write-back run inside the graph: fused, not three eager launches per tensor.
        for (tensors, like, *rest), flag in zip(rows_args, flags):
            kernel_boundary()  # each row's kernels are its own (its sizes are symbols of their own)
            staged, write_back = _stage_tensors(tensors, like, block)
            call_pure(key, discard, *staged, *rest, found_inf=flag)
            _unstage(write_back)

    # A code object of its own per size class: dynamo keeps graphs per code object.
    own_name = f"{name}_{'large' if large else 'small'}{'_combo' if _combo else ''}"
    code = together.__code__.replace(co_name=own_name)
    own = types.FunctionType(code, together.__globals__, own_name, together.__defaults__, together.__closure__)
    options = {**COMPILE_OPTIONS, **_COMBO_OPTIONS} if _combo else COMPILE_OPTIONS
    _graphs[index] = torch.compile(own, dynamic=True, fullgraph=True, options=options)
    return _graphs[index]


@contextlib.contextmanager
def combo_rows(enabled: bool = True) -> Iterator[None]:
    """Inside: a GPU's graphs over rows are built (and taken) with pointwise combo kernels, one
    launch for a chunk's elementwise rows; the same bits (the rows' arithmetic is unchanged)."""
    global _combo
    before, _combo = _combo, enabled
    try:
        yield
    finally:
        _combo = before


def _flag(row: ParamStep) -> dict[str, torch.Tensor]:
    """The found-inf keyword of a row's call. A step without a flag passes a zero flag (made
    once per device): one compiled graph per composition serves both, a zero flag selects the
    new values bit for bit, and the strategies, which always pass one, compile nothing more."""
    if row.found_inf is not None:
        return {"found_inf": row.found_inf}
    device = row.tensors[0].device
    zero = _ZERO_FLAGS.get(device)
    if zero is None:
        zero = _ZERO_FLAGS[device] = torch.zeros((), dtype=torch.float32, device=device)
    return {"found_inf": zero}


_ZERO_FLAGS: dict[torch.device, torch.Tensor] = {}


_graphs: dict[tuple[object, object], Callable[..., object]] = {}


def _compiled_for(key: object, discard: Callable[..., None], parallel: bool) -> Callable[..., object]:
    # One compiled callable per composition and threading for the whole process, so tests and
    # optimizers share graphs (dynamo then recompiles only for new dtypes or devices).
    graph = _graphs.get((key, parallel))
    if graph is None:
        options = COMPILE_OPTIONS if parallel else {**COMPILE_OPTIONS, "cpp.dynamic_threads": False, "cpp.threads": 1}
        # A code object of its own per graph: dynamo caches graphs (and counts its recompile limit)
        # per code object, and every composition's `discard` shares one, so a process stepping
        # many compositions and dtypes would hit the limit across them.
        code = discard.__code__.replace(co_name=f"{discard.__name__}_{int(parallel)}")
        own = types.FunctionType(code, discard.__globals__, code.co_name, discard.__defaults__, discard.__closure__)
        own.__kwdefaults__ = discard.__kwdefaults__
        graph = _graphs[(key, parallel)] = torch.compile(own, dynamic=True, fullgraph=True, options=options)
    return graph
