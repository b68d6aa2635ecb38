"""One training step of a strategy counted at a GPU run's shapes on CPU (`count_step`): the model
built from its config as fake tensors (shapes and dtypes, no values), every branch of the
package switched to the path a CUDA device takes (`compiling.gpu_paths`, FP8 GEMMs by
`torch._scaled_mm`), optionally each decoder layer as one compiled graph (regional compilation,
as the device check's `e2e` section runs). A large model is counted at one and two layers (one
model of two, counted whole and with its second layer out) and scaled to its depth
(`count_scaled`), so planning a 70 B model takes seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any
from unittest import mock

import torch

from ..compiling import count_model_as_compiled, gpu_paths
from ..processes import autograd_context
from .heads import step_labels
from .ledger import Ledger, PhaseCounts
from .models import block_kinds, blocks_of, build_model, layer_overrides, model_config, rule_options
from .peers import ANCHOR, PEERS, TORCHAO, TorchAMP, TorchAOFloat8
from .resident import resident_bytes

__all__ = [
    "ANCHOR",
    "PEERS",
    "TORCHAO",
    "StepCount",
    "count_scaled",
    "count_step",
    "phased_step",
    "start_counts",
    "swap_or_set_data",
    "without_collector",
]


def swap_or_set_data(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """`torch.utils.swap_tensors` for fake tensors: `nn.Module._apply` swaps parameters
    (`.float()`, `.to(dtype)`); a fake tensor the mode holds a weak reference to cannot be
    swapped, and `.data =` does the same for a leaf."""
    try:
        _swap_tensors(t1, t2)
    except RuntimeError:
        t1.data = t2


_swap_tensors = torch.utils.swap_tensors


@dataclasses.dataclass
class StepCount:
    """A counted step: {phase: PhaseCounts}, the peak bytes the step allocated on top of what
    was resident before it, how many decoder layers it was counted at, the resident bytes
    (parameters, buffers, optimizer state), and the peak within each phase."""

    phases: dict[str, PhaseCounts]
    peak_bytes: int
    layers: int
    resident_bytes: int = 0
    phase_peaks: dict[str, int] = dataclasses.field(default_factory=dict)

    def total(self) -> PhaseCounts:
        out = PhaseCounts()
        for counts in self.phases.values():
            out.add(counts)
        return out


def phased_step(
    ledger: Any, strategy: Any, model: Any, optimizer: Any, ids: torch.Tensor, clip: float | None = None
) -> None:
    """One training step as the Trainer drives a strategy, each part inside `ledger.phase(name)`:
    forward (under the strategy's forward context), backward (scaled), clip (unscale and clip,
    if `clip`), then the optimizer step, whose gradient processing is "gradients" and update
    "optimizer", and zero_grad."""
    process, step = strategy.process_gradients, strategy.optimizer_step

    def in_phase(phase: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with ledger.phase(phase):
                return fn(*args, **kwargs)

        return run

    strategy.process_gradients = in_phase("gradients", process)
    strategy.optimizer_step = in_phase("optimizer", step)
    try:
        with ledger.phase("forward"), strategy.forward_context():
            loss = model(input_ids=ids, labels=step_labels(model, ids)).loss
        with ledger.phase("backward"):
            strategy.scale_loss(loss).backward()
        if clip is not None:
            with ledger.phase("clip"):
                strategy.unscale_gradients(optimizer)
                strategy.clip_grad_norm(model.parameters(), clip)
        optimizer.step()
        with ledger.phase("zero_grad"):
            optimizer.zero_grad(set_to_none=True)
    finally:
        del strategy.process_gradients, strategy.optimizer_step


@contextlib.contextmanager
def _compiled_layers(model: torch.nn.Module, ledger: list[Any]) -> Iterator[None]:
    """Each decoder block's forward and backward counted as one compiled graph of the `ledger[0]`
    in use (hooks that open and close its region)."""

    def enter(name: str) -> None:
        ledger[0].enter_layer(name)
        count_model_as_compiled(True)  # the layer's code takes the compiled branches

    def leave() -> None:
        ledger[0].leave_layer()
        count_model_as_compiled(False)

    handles = []
    for index, block in enumerate(blocks_of(model)):
        name = f"layer{index}"
        handles += [
            block.register_forward_pre_hook(lambda *_, name=name: enter(name)),
            block.register_forward_hook(lambda *_: leave()),
            block.register_full_backward_pre_hook(lambda *_, name=name: enter(name)),
            block.register_full_backward_hook(lambda *_: leave()),
        ]
    try:
        yield
    finally:
        count_model_as_compiled(False)
        for handle in handles:
            handle.remove()


def count_step(
    name: str,
    model: str,
    batch: tuple[int, int],
    layers: int | None = None,
    compiled_layers: bool = True,
    clip: float | None = 1.0,
    warmup: int = 1,
    gpu: Any = None,
    replays: dict | None = None,
    **options: Any,
) -> StepCount:
    """The ledger of one steady step (after `warmup`) of strategy `name` on `model` (a name of
    `planning.models.MODELS` or a config.json) at `layers` decoder layers (the config's unset),
    `batch` = (sequences, tokens each), gradients clipped to `clip` as the Trainer clips. With a
    `gpu` (a `hardware.GPU`), FP8 strategies keep in BF16 what FP8 would not speed up there, as
    they do when they run on it (`models.rule_options`). `replays`: the pure calls recorded by
    earlier counts of the same strategy (`Ledger.call_pure`), shared with this one."""
    return _count_steps(name, model, batch, layers, compiled_layers, clip, warmup, gpu, replays, [None], options)[0]


def _count_steps(
    name: str,
    model: str,
    batch: tuple[int, int],
    layers: int | None,
    compiled_layers: bool,
    clip: float | None,
    warmup: int,
    gpu: Any,
    replays: dict | None,
    hidden: list[int | None],
    options: dict[str, Any],
    keep: list[int] | None = None,
) -> list[StepCount]:
    """`count_step`'s steady step, counted once per entry of `hidden`: with the decoder block at
    that position taken out (None: every block in). A block taken out counts what the model
    without it counts, for the strategies outside `_DEPTH_BOUND`: its gradients are None, so the
    optimizer passes over its parameters (tests/planning/test_shortcuts.py holds the two equal).
    `keep`: the model built at its depth, then only these blocks of it kept, in this order."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.nn import Parameter
    from torch.utils import _foreach_utils

    import hf_lowprec
    from hf_lowprec.fp8.gemm import forced_fp8_gemm_path, set_fp8_gemm_path

    options = {**rule_options(name, gpu, batch[0] * batch[1]), **options}
    config, _ = model_config(model)
    overrides: dict[str, Any] = {"use_cache": False}
    if layers is not None:
        overrides.update(layer_overrides(config, layers))
    replays = {} if replays is None else replays
    counted = [Ledger(recording=False, replays=replays)]
    forced = forced_fp8_gemm_path()
    set_fp8_gemm_path("scaled_mm")
    try:
        with (
            without_collector(),
            warnings.catch_warnings(),
            torch.compiler.set_stance("force_eager"),
            mock.patch("torch.utils.swap_tensors", swap_or_set_data),
            # torch takes its multi-tensor paths (clipping, optimizers) for plain tensors only.
            mock.patch.object(_foreach_utils, "_foreach_supported_types", [torch.Tensor, Parameter, FakeTensor]),
            gpu_paths(),
            _unpacked_batches(),
            # The fake mode's cache of operations (shapes out for shapes in) serves the warm-up's
            # operations to the counted step, one block's to the next, one strategy's to the next.
            torch._dynamo.config.patch(fake_tensor_cache_enabled=True),
            FakeTensorMode(allow_non_fake_inputs=True),
        ):
            # The FP8 weight cache keys on the weight's data pointer, which a fake tensor reads
            # with a deprecation warning: harmless here (the cache holds for the counted steps).
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            # Building, preparing and the warm-up run under a ledger that records nothing (it
            # answers the host's reads): only the steady step is counted.
            with counted[0]:
                peers = {ANCHOR: TorchAMP, TORCHAO: TorchAOFloat8}
                strategy = peers[name]() if name in peers else hf_lowprec.get_strategy(name, **options)
                built = build_model(model, device="cpu", **overrides)
                if keep is not None:
                    _keep_blocks(built, keep)
                built = strategy.prepare_model(built)
                optimizer = strategy.create_optimizer(
                    [p for p in built.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01
                )
                vocab = getattr(built.config, "vocab_size", 1024)
                ids = torch.randint(0, vocab, batch)
            depth = len(blocks_of(built))
            with _compiled_layers(built, counted) if compiled_layers else contextlib.nullcontext():
                with counted[0]:
                    for _ in range(warmup):
                        phased_step(counted[0], strategy, built, optimizer, ids, clip)
                out = []
                for index in hidden:
                    with _without_block(built, index):
                        resident = resident_bytes(built, optimizer)
                        steady = counted[0] = Ledger(replays=replays)
                        with steady:
                            phased_step(steady, strategy, built, optimizer, ids, clip)
                    counts, peaks = steady.counts(), dict(steady.phase_peaks)
                    out.append(StepCount(counts, steady.peak_bytes, depth - (index is not None), resident, peaks))
    finally:
        set_fp8_gemm_path(forced)
    return out


@contextlib.contextmanager
def _unpacked_batches() -> Iterator[None]:
    """transformers' packed-sequence check (`masking_utils.find_packed_sequence_indices`) answering None
    after its kernels, as on a real batch of whole sequences (SDPA causal, no mask): fake tensors cannot."""
    from transformers import masking_utils

    check = masking_utils.find_packed_sequence_indices

    def unpacked(position_ids: torch.Tensor) -> None:
        check(position_ids)

    with mock.patch.object(masking_utils, "find_packed_sequence_indices", unpacked):
        yield


@contextlib.contextmanager
def without_collector() -> Iterator[None]:
    """The cyclic garbage collector off in the scope (as it was after): a count makes hundreds of
    thousands of short-lived objects, which reference counting frees; its passes were 15% of the time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _set_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
    """Makes `blocks` `model`'s decoder blocks, in this order (indexed from 0, as built)."""
    listed = blocks_of(model)
    listed._modules.clear()
    listed._modules.update({str(i): block for i, block in enumerate(blocks)})


def _keep_blocks(model: torch.nn.Module, indices: list[int]) -> None:
    """Leaves `model` only the decoder blocks at `indices` (and their config's `layer_types`), as built."""
    blocks = list(blocks_of(model))
    types = getattr(model.config, "layer_types", None)
    if isinstance(types, list) and len(types) == len(blocks):
        model.config.layer_types = [types[i] for i in indices]
    _set_blocks(model, [blocks[i] for i in indices])


@contextlib.contextmanager
def _without_block(model: torch.nn.Module, index: int | None) -> Iterator[None]:
    """In the scope, `model`'s decoder block at `index` (None: none) is out of its block list."""
    if index is None:
        yield
        return
    blocks = list(blocks_of(model))
    _set_blocks(model, blocks[:index] + blocks[index + 1 :])
    try:
        yield
    finally:
        _set_blocks(model, blocks)


# Strategies whose step over a model depends on blocks that did not run (state shared by all
# layers: FP16 loss scaling's per-layer statistics): counted at one and two blocks built as such.
# (fp8-lm-o3 was one until its one-process step left an FP8 weight without a gradient alone.)
_DEPTH_BOUND = {"fp16-als"}


def depth_bound(name: str, options: dict[str, Any]) -> bool:
    """Whether strategy `name` with `options` is counted on models built at each depth: the
    `_DEPTH_BOUND` strategies, and any with the guard on (it gathers every FP8 layer's flush
    counts in each forward, a block taken out's included)."""
    return name in _DEPTH_BOUND or options.get("guard", False) not in (False, None)  # True, or its settings


def count_scaled(name: str, model: str, batch: tuple[int, int], **kwargs: Any) -> StepCount:
    """`count_step` at the model's full depth, counted at one and two decoder layers and
    extrapolated linearly (blocks of one kind cost the same): one model of two blocks counted whole
    and with its second block out (`_DEPTH_BOUND` strategies: two models built). A model whose blocks
    are of several kinds (DeepSeek-V3) is counted on one block of each (`_count_kinds`, `_count_kinds_built`)."""
    config, _ = model_config(model)
    depth = next(getattr(config, k) for k in ("num_hidden_layers", "n_layer", "num_layers") if hasattr(config, k))
    if depth <= 2:
        return count_step(name, model, batch, layers=depth, **kwargs)
    kwargs.setdefault("replays", {})  # the second count replays the first's casts and optimizer rows
    kinds = block_kinds(model)
    if len(kinds) > 1:
        return (_count_kinds_built if depth_bound(name, kwargs) else _count_kinds)(name, model, batch, kinds, kwargs)
    if depth_bound(name, kwargs):
        one = count_step(name, model, batch, layers=1, **kwargs)
        two = count_step(name, model, batch, layers=2, **kwargs)
    else:  # one model of two blocks, counted whole and with its second block out
        two, one = _count_steps(name, model, batch, 2, *_step_args(kwargs), [None, 1], kwargs)
    return _combined(one, [(two, depth - 1)], depth)


def _combined(base: StepCount, steps: list[tuple[StepCount, int]], layers: int) -> StepCount:
    """`base` plus n times each (step, n)'s difference from it, phase by phase (n < 0: a block out)."""
    phases: dict[str, PhaseCounts] = {}
    for phase in {*base.phases, *(phase for step, _ in steps for phase in step.phases)}:
        b = base.phases.get(phase, PhaseCounts())
        scaled = PhaseCounts()
        scaled.add(b, 1 - sum(n for _, n in steps))
        gemms = list(b.gemm_kernels)
        for step, n in steps:
            c = step.phases.get(phase, PhaseCounts())
            scaled.add(c, n)
            gemms += _extra_kernels(b, c) * n if n > 0 else _extra_kernels(c, b) * -n
        scaled.gemm_kernels = gemms
        phases[phase] = scaled
    peaks = _scaled_peaks(base, steps)
    resident = base.resident_bytes + sum(n * (step.resident_bytes - base.resident_bytes) for step, n in steps)
    return StepCount(phases, max(peaks.values()), layers, resident, peaks)


def _scaled_peaks(base: StepCount, steps: list[tuple[StepCount, int]]) -> dict[str, int]:
    """Each phase's peak at full depth, `base`'s plus n times each (step, n)'s change to it: at one
    and two blocks the step's one peak may lie where little grows with depth (a large vocabulary's logits)."""
    grown = {p: sum(n * (step.phase_peaks.get(p, 0) - b) for step, n in steps) for p, b in base.phase_peaks.items()}
    return {phase: base.phase_peaks[phase] + extra for phase, extra in grown.items()}


def _count_kinds(
    name: str, model: str, batch: tuple[int, int], kinds: list[list[int]], kwargs: dict[str, Any]
) -> StepCount:
    """`count_scaled` of a model whose blocks are of several `kinds` (`models.block_kinds`): one
    block of each kind kept from the whole model, its step counted whole (W) and with each kind's
    block taken out in turn (X_k). A block of kind k costs W − X_k, so the model of n_k blocks of
    each kind counts W + Σ (n_k − 1)(W − X_k)."""
    positions: list[int | None] = [None, *range(len(kinds))]
    whole, *without = _count_steps(
        name, model, batch, None, *_step_args(kwargs), positions, kwargs, keep=[k[0] for k in kinds]
    )
    return _combined(whole, [(x, 1 - len(kind)) for x, kind in zip(without, kinds)], sum(map(len, kinds)))


def _count_kinds_built(
    name: str, model: str, batch: tuple[int, int], kinds: list[list[int]], kwargs: dict[str, Any]
) -> StepCount:
    """`_count_kinds` for the `depth_bound` strategies, whose state spans every block a model is
    built with: models built of one block of each kind (W; blocks kept before the strategy prepares
    the model), and of those and a second block of kind k (Y_k). A block of kind k costs Y_k − W."""
    args, first = _step_args(kwargs), [kind[0] for kind in kinds]

    def counted(keep: list[int]) -> StepCount:
        return _count_steps(name, model, batch, None, *args, [None], kwargs, keep=keep)[0]

    more = [(counted(sorted([*first, kind[1]])), len(kind) - 1) for kind in kinds if len(kind) > 1]
    return _combined(counted(first), more, sum(map(len, kinds)))


def _step_args(kwargs: dict[str, Any]) -> list[Any]:
    """`count_step`'s compiled_layers, clip, warmup, gpu and replays, taken out of `kwargs` (the
    strategy's options are what stays), for `_count_steps`."""
    defaults = (("compiled_layers", True), ("clip", 1.0), ("warmup", 1), ("gpu", None), ("replays", None))
    return [kwargs.pop(key, default) for key, default in defaults]


def _extra_kernels(a: PhaseCounts, b: PhaseCounts) -> list:
    """The GEMM kernels one more layer adds: those of `b` beyond `a`'s (same order, same shapes)."""
    remaining = list(a.gemm_kernels)
    extra = []
    for kernel in b.gemm_kernels:
        if kernel in remaining:
            remaining.remove(kernel)
        else:
            extra.append(kernel)
    return extra


def start_counts(
    names: list[str], model: str, batch: tuple[int, int], **kwargs: Any
) -> Callable[[], dict[str, StepCount]]:
    """Starts `count_scaled` of every strategy in `names` and returns the call that waits for
    them: {name: StepCount}. On Linux with two or more cores the counts run in forked worker
    processes, one per core, while the caller goes on (a count is pure Python: one core each);
    elsewhere, or if a worker dies, they run in this process when the results are asked for."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(cores, len(names))
    if workers < 2 or not sys.platform.startswith("linux"):
        return lambda: {name: count_scaled(name, model, batch, **kwargs) for name in names}
    block_kinds(model)  # worked out once, here: forked workers inherit it
    # gc.freeze: a worker's collections never walk the objects it was forked with.
    pool = ProcessPoolExecutor(workers, mp_context=autograd_context([__name__]), initializer=gc.freeze)
    # The longest counts first (FP8 layers: casts and their state; two models built), so that
    # no worker is left with a long one at the end while the other waits.
    longest_first = sorted(names, key=lambda name: not rule_options(name) and not depth_bound(name, kwargs))
    futures: dict[str, Future] = {
        name: pool.submit(count_scaled, name, model, batch, **kwargs) for name in longest_first
    }

    def results() -> dict[str, StepCount]:
        counted = {}
        try:
            for name, future in futures.items():
                try:
                    counted[name] = future.result()
                except BrokenProcessPool:  # a worker died (killed, out of memory): count it here
                    counted[name] = count_scaled(name, model, batch, **kwargs)
        finally:
            pool.shutdown(cancel_futures=True)
        return {name: counted[name] for name in names}

    return results
