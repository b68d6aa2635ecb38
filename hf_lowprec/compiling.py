"""Whether `torch.compile` can build kernels on a device here, which call is one of the package's
compiled graphs (`compiled_region`), `run_fused`, which runs a function of tensors as one
compiled graph, and `run_fused_rows`, which runs one over a list in chunks: shared by every
compiled path."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import shutil
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])
logger = logging.getLogger(__name__)

__all__ = [
    "LARGE_ROW",
    "ROWS_PER_GRAPH",
    "call_pure",
    "chunks_of",
    "compiled_region",
    "compiler_missing",
    "constant",
    "current_compiled_region",
    "gpu_paths",
    "count_model_as_compiled",
    "in_compiled_model",
    "in_torch_func",
    "kernel_boundary",
    "one_graph_for_every_size",
    "own_graphs",
    "raised_at",
    "run_fused",
    "run_fused_rows",
    "takes_gpu_path",
]

_regions: list[tuple[str, int]] = []
_gpu_paths_forced = [False]


def takes_gpu_path(device) -> bool:
    """Whether work on `device` takes the GPU's form (multi-tensor operations, compiled steps) rather
    than the CPU's (per-tensor loops, native kernels): on any accelerator, and on CPU inside
    `gpu_paths()`, where the launch counters count a GPU step on CPU tensors."""
    return device.type != "cpu" or _gpu_paths_forced[0]


def in_torch_func() -> bool:
    """Whether a torch.func transform (`grad`, `vjp`, `vmap`) is running: its tensors are wrappers
    with no storage nor version counter, it refuses in-place writes into tensors captured from
    outside it and saved-tensor hooks, and it owns the gradients it computes; so per-step caches,
    tallies, gradient sinks, packed activations and compiled graphs stand aside."""
    import torch

    if torch.compiler.is_compiling():  # dynamo traces the transforms on its own
        return False
    return torch._C._functorch.maybe_current_level() is not None


@contextlib.contextmanager
def gpu_paths() -> Iterator[None]:
    """Within the scope, CPU tensors take the paths a CUDA device takes (`takes_gpu_path`): same
    bits, other kernels. For counting launches (`hf_lowprec.testing.launches`), not for speed."""
    previous, _gpu_paths_forced[0] = _gpu_paths_forced[0], True
    try:
        yield
    finally:
        _gpu_paths_forced[0] = previous


_counted_as_compiled = [False]


def in_compiled_model() -> bool:
    """Whether the model's code runs as a `torch.compile` graph: traced by dynamo, or in a decoder
    layer a step ledger counts as compiled (`count_model_as_compiled`), where the code takes the
    branch compiling takes (an FP8 layer casts its weight in the graph, at every forward)."""
    import torch

    return _counted_as_compiled[0] or torch.compiler.is_compiling()


def count_model_as_compiled(compiled: bool) -> None:
    """Set by the step ledger on entering (True) and leaving (False) a layer it counts as one
    compiled graph (`planning.counting`); `in_compiled_model()` follows it."""
    _counted_as_compiled[0] = compiled


_serials = itertools.count()


@contextlib.contextmanager
def compiled_region(name: str) -> Iterator[None]:
    """Marks one call of a compiled graph of the package (an FP8 cast, an optimizer step). A
    launch counter that sees its operations run eagerly (counters run compiled code as its
    eager source) counts the call as one graph, not as a launch per operation
    (`hf_lowprec.testing.launches`). Costs an append and a pop."""
    _regions.append((name, next(_serials)))
    try:
        yield
    finally:
        _regions.pop()


def call_pure(key: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs): a compiled graph's source or one part of it (an FP8 cast, an optimizer
    row), a pure function of tensors named by `key`. Under a dispatch mode that replays such calls
    (the step ledger, `hf_lowprec.planning.ledger.Ledger.call_pure`), that mode runs it."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if not torch.compiler.is_compiling():
        replay = getattr(_get_current_dispatch_mode(), "call_pure", None)
        if replay is not None:
            return replay(key, fn, args, kwargs)
    return fn(*args, **kwargs)


def kernel_boundary() -> None:
    """In a compiled graph's source, between parts that Inductor does not fuse into one kernel
    (the rows of a chunk of the optimizer's rows: each row's sizes are symbols of their own): a
    step ledger running the source eagerly ends the kernel open there
    (`planning.ledger.Ledger.end_kernel`). Nothing otherwise, and nothing in the graph."""
    import torch

    if torch.compiler.is_compiling():
        return
    end = getattr(torch.utils._python_dispatch._get_current_dispatch_mode(), "end_kernel", None)
    if end is not None:
        end()


def current_compiled_region() -> tuple[str, int] | None:
    """(name, serial of the call) of the innermost compiled region running, or None."""
    return _regions[-1] if _regions else None


@functools.cache
def compiler_missing(device_type: str) -> str | None:
    """Why compiled kernels cannot run on `device_type`, or None if they can."""
    if device_type == "cpu":
        from torch._inductor import config

        compiler = config.cpp.cxx[1] if isinstance(config.cpp.cxx, tuple) and config.cpp.cxx[1] else "g++"
        if not any(shutil.which(c) for c in (compiler, "g++", "c++", "clang++")):
            return "no C++ compiler on PATH"
        return None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        try:
            usable = has_triton()
        except RuntimeError as error:  # a CUDA build of torch asked about a device it cannot reach
            return f"Triton cannot inspect the CUDA device ({error})"
        return None if usable else "Triton is not installed"
    return f"device type {device_type!r} has no Inductor backend here"


def constant(fn: _F) -> _F:
    """`functools.cache` for a function that builds a constant table on the host (CPU devices
    only among its arguments): built outside any dispatch mode, so a table first asked for while
    a planner counts a step on fake tensors (`hf_lowprec.planning`) is a real one, which later
    real steps can use."""
    cached = functools.cache(fn)

    @functools.wraps(fn)
    def get(*args: Any) -> Any:
        import torch
        from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

        on_host = all(a.type == "cpu" for a in args if isinstance(a, torch.device))
        if not on_host or torch.compiler.is_compiling() or _get_current_dispatch_mode() is None:
            return cached(*args)
        with _disable_current_modes():
            return cached(*args)

    get.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return get  # type: ignore[return-value]


# Input dtypes × FP8 formats, plus the sizes Inductor specialises (0 and 1): dynamo's default
# limit of 8 graphs per function would be reached in one process that quantizes all of them.
_RECOMPILE_LIMIT = 32


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    # One graph per (input dtype, FP8 format), paid once per process and cached on disk by
    # Inductor (`TORCHINDUCTOR_CACHE_DIR`); a failure to compile is logged once and the eager
    # ops are used from then on (`_run_compiled`).
    # cpp.dynamic_threads: the parallel region is sized by OpenMP at run time, not from the
    # size of the first tensor (see `hf_lowprec.optim.dispatch`).
    return torch.compile(fn, dynamic=True, fullgraph=True, options={"cpp.dynamic_threads": True})


# The functions whose graph failed to build or run (function → error): each runs eagerly from then on,
# the others stay compiled.
_broken: dict[Callable[..., Any], str] = {}


def _eager_here(tensor: Any, fn: Callable[..., Any]) -> bool:
    """Whether the plain torch ops of `fn` must run instead of its compiled kernels: inside a
    `torch.compile`d model (a nested compiled function cannot be inlined; Inductor fuses the plain
    ops into the caller's kernels), where no compiler is found, after `fn`'s compile failed, or within
    a torch.func transform (the eager ops are what the transform differentiates or batches).

    On CPU the kernels are C++/OpenMP loops, on CUDA Triton kernels: the same graph, so a GPU
    gets its few launches per tensor where the eager ops would issue a chain of small ones.
    """
    import torch

    return (
        torch.compiler.is_compiling()
        or fn in _broken
        or compiler_missing(tensor.device.type) is not None
        or in_torch_func()
    )


def run_fused(fn: Callable[..., Any], *args: Any, like: Any) -> Any:
    """fn(*args) as one compiled graph on `like`'s device (an FP8 cast, a loss scaler's tallies),
    or eagerly where the compiled kernels cannot run (`_eager_here`; also on a torch.func wrapper). `fn` is a module-level
    function of tensors (one compiled callable per function, dynamic shapes: flatten the inputs).
    On a GPU a `like` of LARGE_ROW elements or more gets graphs of its own (`_sized`): a graph
    built on a small tensor would reduce a large one in a single thread block.

    Under a Python dispatch mode (fake tensors, op counters) dynamo refuses to run: the eager ops
    serve the call, marked as the one compiled graph they stand for (`compiled_region`), and the
    compiled kernels stay in use afterwards."""
    import torch

    if takes_gpu_path(like.device):
        fn = _sized(fn, like.numel() >= LARGE_ROW)
    if _eager_here(like, fn):
        return fn(*args)
    with compiled_region(fn.__name__):
        if torch.utils._python_dispatch._get_current_dispatch_mode() is not None:
            return call_pure(fn, fn, *args)
        return _run_compiled(fn, like.device.type, *args)


def _run_compiled(fn: Callable[..., Any], device_type: str, *args: Any) -> Any:
    import torch

    try:
        # Autocast changes nothing here (products and casts); disabling it keeps one graph.
        # optimize_ddp off: called inside a DDP model's forward, dynamo would split these
        # one-kernel graphs by DDP's buckets (and fail); they hold no DDP module.
        with (
            torch.autocast(device_type, enabled=False),
            torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT, optimize_ddp=False),
        ):
            return _compiled(fn)(*args)
    except Exception as error:  # any backend failure: this function's eager ops, for good
        _broken[fn] = f"{type(error).__name__}: {error}"
        logger.warning("compiling %s failed (%s); using its eager operations", fn.__name__, _broken[fn])
        return fn(*args)


# A graph over a list of rows (the optimizer's parameters, every gradient) is unrolled, and its
# build grows with the rows: 332 s for 75 optimizer rows on two CPU cores, 142 s of warm-up on an
# H200 (2026-12-04). Compiled in chunks of at most ROWS_PER_GRAPH rows (`chunks_of`), within groups
# a graph serves whole, a function builds a few graphs whatever the model. Rows of LARGE_ROW
# elements or more get graphs of their own: Inductor splits a whole-tensor reduction by the size a
# graph was built for, and a graph built on a bias would reduce a large weight in one block.
ROWS_PER_GRAPH = 8
LARGE_ROW = 65536


def chunks_of(count: int) -> list[slice]:
    """How `count` rows are split into compiled calls: chunks of ROWS_PER_GRAPH rows, then the
    rest in halving sizes (75 rows: 9 × 8, 2 and 1), so a group needs graphs of at most four
    sizes and a step makes one call per chunk."""
    chunks, start, size = [], 0, ROWS_PER_GRAPH
    while start < count:
        while size > count - start:
            size //= 2
        chunks.append(slice(start, start + size))
        start += size
    return chunks


def run_fused_rows(fn: Callable[..., Any], rows: list[Any], *args: Any, like: Any) -> list[Any]:
    """`fn(rows, *args)` for a function whose rows are independent (each a tensor or a tuple of
    them; it returns a list with an entry per row, or None), as `run_fused` calls over chunks of
    rows (`chunks_of`) grouped by what a graph guards on (each tensor's rank and dtype) and by
    size class (LARGE_ROW). Returns the entries in the rows' order (None where fn returns None).
    On CPU, or where the compiled kernels cannot run, one call over all rows (`run_fused`)."""
    if _eager_here(like, fn) or not takes_gpu_path(like.device):
        out = run_fused(fn, rows, *args, like=like)
        return [None] * len(rows) if out is None else list(out)
    groups: dict[tuple, list[int]] = {}
    for index, row in enumerate(rows):
        tensors = row if isinstance(row, (tuple, list)) else (row,)
        key = tuple((t.dim(), t.dtype) if hasattr(t, "dtype") else None for t in tensors)
        groups.setdefault((key, tensors[0].numel() >= LARGE_ROW), []).append(index)
    results: list[Any] = [None] * len(rows)
    for indices in groups.values():
        for chunk in chunks_of(len(indices)):
            part = indices[chunk]
            first = rows[part[0]]
            # The chunk's first tensor: its size class is the group's (`run_fused` sizes by it).
            first = first[0] if isinstance(first, (tuple, list)) else first
            out = run_fused(fn, [rows[i] for i in part], *args, like=first)
            for i, entry in zip(part, out if out is not None else [None] * len(part)):
                results[i] = entry
    return results


def _sized(fn: _F, large: bool) -> _F:
    """`fn` with a code object of its own for the large size class, under the same name: a launch
    counter sees the same graph."""
    return own_graphs(fn, "large") if large else fn


def own_graphs(fn: _F, key: Any) -> _F:
    """`fn` with a code object of its own for `key`, under the same name. Dynamo keeps graphs, and
    counts its recompile limit, per code object: a function whose calls differ in something its
    graph is guarded on (a list's length: one graph per length) gets a copy per value, so that no
    number of values reaches the limit (past it, dynamo runs the eager operations for good).
    While dynamo traces a caller (a model compiled whole), `fn` itself: the call is part of that
    graph, and making a code object would break it."""
    import torch

    if torch.compiler.is_compiling():
        return fn
    return _own_graphs(fn, key)


@functools.cache
def _own_graphs(fn: _F, key: Any) -> _F:
    import types

    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__, own.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return own  # type: ignore[return-value]


def raised_at(error: BaseException) -> str:
    """Where `error` was raised (its innermost frame), for the log line of a compile failure: an
    Inductor error often has an empty message (a bare assert), and the fallback hides the traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return f", raised at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"


def one_graph_for_every_size() -> contextlib.AbstractContextManager:
    """Two habits of dynamic shapes would compile a composition more than once (each graph of a
    grouped format costs about a minute on two CPU cores):

    - a dimension of size 1 is specialised even under `dynamic=True`: a group format's first
      parameter of one block (a bias, a LayerNorm weight) or a one-element parameter would get a
      graph of its own. Size-oblivious reasoning keeps the general graph; the step broadcasts no
      size-1 dimension, so its values are the same;
    - duck sizing gives two dimensions one symbol when their first sizes happen to be equal (a
      staged parameter and a stored payload of another layout), and the first parameter where
      they differ recompiles. Dimensions the step really combines are still unified, by guards."""
    import torch.fx.experimental._config as shape_config

    options = _one_graph_options()
    return shape_config.patch(**options) if options else contextlib.nullcontext()


@functools.cache
def _one_graph_options() -> dict[str, bool]:
    """Decided once, not at every step (older torch releases lack one or both options)."""
    import torch.fx.experimental._config as shape_config

    wanted = {"backed_size_oblivious": True, "use_duck_shape": False}
    return {name: value for name, value in wanted.items() if hasattr(shape_config, name)}
