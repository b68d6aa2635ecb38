"""Which Trainer checkpoint a run resumes from, checked before any state changes.

The stock `transformers.Trainer` resumes (`resume_from_checkpoint=True`) from the highest
numbered `checkpoint-N` directory, whether or not its save finished: a run killed while it
wrote checkpoint N then either fails with a traceback from deep inside the loader or, worse,
loads N's new weights with no optimizer state. The Trainer writes `trainer_state.json` last
(after the weights, optimizer, scheduler and RNG states), so a checkpoint whose
`trainer_state.json` is missing or cut short is one whose save was interrupted: it is skipped,
with a warning. A finished checkpoint whose files are damaged, or that another precision
strategy saved, is refused with an error that names the file and what to do.

Every checkpoint the package's Trainer saves under a strategy carries a manifest
(`hf_lowprec_manifest.json`, `hf_lowprec.checkpoints.manifest`): each file with its size and
CRC-32, the precision strategy, its options and the number of processes that saved it. The save
is bracketed: `begin_save` writes a marker (`hf_lowprec_save_in_progress`) before any file, and
`finish_save` writes the manifest once every rank's files exist, then removes the marker. So a
checkpoint with the marker and no manifest is an interrupted save (a rank died before its files
existed, say), never an old one, and older checkpoints are rotated away only after it.

A resume checks presence, sizes and checksums before anything is loaded. A missing or damaged
optimizer, scheduler or RNG file is refused unless the run names that part in `resume_reset`,
which says what starts afresh; anything else missing or damaged is always refused. A checkpoint
without marker and manifest (saved before manifests existed) gets the archive checks below and
a one-line warning. A save that fails (a full disk, a permission) is reported naming the file
and the cause, and that the previous checkpoint is intact (`failed_save`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import zipfile
from collections.abc import Callable
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .manifest import (
    MANIFEST,
    ManifestError,
    crash_point,
    file_problem,
    read_manifest,
    write_failure,
    write_manifest,
)

__all__ = [
    "MANIFEST",
    "IncompleteCheckpointError",
    "SAVE_MARKER",
    "RESETTABLE",
    "CheckpointSaveError",
    "save_complete_checkpoint",
    "begin_save",
    "finish_save",
    "failed_save",
    "incomplete_reason",
    "last_complete_checkpoint",
    "check_checkpoint",
    "parse_resume_reset",
    "resolve_resume_checkpoint",
]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SAVE_MARKER = "hf_lowprec_save_in_progress"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")

# Parts of the training state a resume may start afresh (`resume_reset`), what that means, and
# the checkpoint files that hold them. Weights, the trainer state and the rest are never reset.
RESETTABLE: dict[str, str] = {
    "optimizer": "the optimizer starts afresh: moments at zero, the strategy's state "
    "(compensation δθ, loss scale, FP8 gradient scale μ, skipped-step count) at its initial value",
    "scheduler": "the learning-rate schedule restarts at its first step (warmup included)",
    "rng": "the random generators are not restored: data order and dropout no longer repeat the uninterrupted run",
}
_RESET_FILES = {
    "optimizer": re.compile(r"^(optimizer\.(pt|bin)|rank\d+-of-\d+-optimizer\.pt)$"),
    "scheduler": re.compile(r"^scheduler\.pt$"),
    "rng": re.compile(r"^rng_state(_\d+)?\.pth$"),
}


class IncompleteCheckpointError(FileNotFoundError, ValueError):
    """A named checkpoint without `trainer_state.json`: a `FileNotFoundError` as the stock Trainer
    raises there, and a `ValueError` as the package's other refusals."""


def incomplete_reason(path: str) -> str | None:
    """Why `path` is not a finished Trainer checkpoint (its save was interrupted), or None."""
    state_file = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(state_file):
        return f"{TRAINER_STATE} is missing"
    try:
        with open(state_file, encoding="utf-8") as f:
            state = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        return f"{TRAINER_STATE} is cut short or unreadable ({err})"
    if not isinstance(state, dict) or "global_step" not in state:
        return f"{TRAINER_STATE} holds no global_step"
    if os.path.isfile(os.path.join(path, SAVE_MARKER)) and not os.path.isfile(os.path.join(path, MANIFEST)):
        return (
            f"{SAVE_MARKER} is there and {MANIFEST} is not: hf_lowprec began this save and not every "
            "rank's files were written (a process stopped inside the save)"
        )
    return None


def last_complete_checkpoint(output_dir: str, exclude: str | None = None, quiet: bool = False) -> str | None:
    """The highest-numbered finished `checkpoint-N` in `output_dir` (other than `exclude`);
    each newer, unfinished one is skipped with a warning that says why (unless `quiet`)."""
    if not os.path.isdir(output_dir):
        return None
    numbered = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_DIR.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path) and (exclude is None or os.path.abspath(path) != os.path.abspath(exclude)):
            numbered.append((int(match.group(1)), path))
    for _, path in sorted(numbered, reverse=True):
        reason = incomplete_reason(path)
        if reason is None:
            return path
        if not quiet:
            logger.warning(
                "skipping incomplete checkpoint %s: %s (its save was interrupted); resuming from an earlier one",
                path,
                reason,
            )
    return None


def _damaged(path: str, name: str, what: str, hint: str = "") -> ValueError:
    """The refusal of checkpoint file `name` in `path`; `what` is "missing" or "damaged (why)"."""
    what = what if what == "missing" else f"damaged ({what})"
    return ValueError(
        f"checkpoint file {os.path.join(path, name)} is {what}. Nothing was loaded. "
        f"Delete {path} and resume with resume_from_checkpoint=True (the last complete checkpoint before it), "
        f"or pass resume_from_checkpoint=<an earlier checkpoint directory>{hint}"
    )


def _check_files(path: str) -> None:
    from safetensors import SafetensorError, safe_open

    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".safetensors"):
            try:
                with safe_open(file, framework="pt"):
                    pass  # opening validates the header and that the data covers the file
            except (SafetensorError, OSError) as err:
                raise _damaged(path, name, f"not a complete safetensors file: {err}") from None
        elif name.endswith((".pt", ".pth", ".bin")):
            # torch.save writes a zip archive with a CRC-32 per entry: truncation loses the
            # central directory, corruption fails the CRC.
            try:
                with zipfile.ZipFile(file) as archive:
                    bad = archive.testzip()
            except (zipfile.BadZipFile, OSError) as err:
                raise _damaged(path, name, f"not a complete torch.save archive: {err}") from None
            if bad is not None:
                raise _damaged(path, name, f"entry {bad} fails its CRC check")


def _check_strategy(path: str, strategy: Any) -> None:
    """The strategy (and options, where saved) in `optimizer.pt` against this run's, for a checkpoint without manifest."""
    file = os.path.join(path, OPTIMIZER)
    if not os.path.isfile(file):  # DeepSpeed and sharded layouts keep their own optimizer files
        return
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    ours = state.get("hf_lowprec") if isinstance(state, dict) else None
    saved = ours.get("strategy") if isinstance(ours, dict) else None
    name = strategy.name if strategy is not None else None
    if saved != name:
        _refuse_strategy(file, path, saved, name)
    if strategy is not None and isinstance(ours.get("options"), dict):
        strategy.check_resume_options(ours["options"], file)


def _refuse_strategy(file: str, path: str, saved: str | None, strategy: str | None) -> None:
    restart = f"to change strategy, start a new run from the weights in {path} without resume_from_checkpoint"
    if saved is None:
        raise ValueError(
            f"{file} was saved without a precision strategy, but this run uses precision_strategy={strategy!r}; "
            f"resume without --precision_strategy, or {restart}"
        )
    used = f"precision_strategy={strategy!r}" if strategy is not None else "no precision strategy"
    raise ValueError(
        f"{file} was saved by precision strategy {saved!r}, but this run uses {used}; "
        f"resume with --precision_strategy {saved}, or {restart}"
    )


def _checkpoint_files(path: str) -> list[str]:
    """Every file under `path` (DeepSpeed keeps its own in a sub-directory), relative, sorted."""
    found = []
    for root, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path).replace(os.sep, "/")
            if rel not in (MANIFEST, SAVE_MARKER) and not name.startswith(f"{MANIFEST}."):
                found.append(rel)
    return sorted(found)


def begin_save(path: str, strategy: Any) -> None:
    """Mark `path` as a save in progress, before any of its files is written (the main process).

    The marker outlives a kill anywhere in the save; a manifest left from an earlier save into
    the same directory goes (after the marker exists), since its files are about to change.
    """
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, SAVE_MARKER), "w", encoding="utf-8") as f:
        json.dump({"saved_by": "hf_lowprec", "strategy": strategy.name if strategy is not None else None}, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(os.path.join(path, MANIFEST)):
        os.remove(os.path.join(path, MANIFEST))


def finish_save(path: str, strategy: Any, world_size: int) -> None:
    """Write the manifest of `path` (every rank's files must exist: call after a barrier), then drop the marker."""
    options = dataclasses.asdict(strategy.options) if strategy is not None else None
    guard = getattr(strategy, "guard", None)
    # What the guard did, for a reader of the checkpoint (the state to resume is in the optimizer's file).
    acted = {"guard": {"raised": dict(guard.raised), "actions": list(guard.actions)}} if guard is not None else {}
    write_manifest(
        path,
        _checkpoint_files(path),
        strategy=strategy.name if strategy is not None else None,
        options=options,
        world_size=world_size,
        **acted,
    )
    marker = os.path.join(path, SAVE_MARKER)
    if os.path.exists(marker):
        os.remove(marker)


def save_complete_checkpoint(trainer: Any, save: Callable[[Any], None], trial: Any) -> None:
    """Run `save(trial)` (the stock `Trainer._save_checkpoint`) so that the checkpoint is complete
    on every rank before older ones are rotated away: the marker first, the stock save with its
    rotation held back, a barrier (every rank's RNG state and DeepSpeed partitions are written),
    the manifest, then the rotation (`save_total_limit`). A failure names the file and the cause."""
    args = trainer.args
    run_dir = trainer._get_output_dir(trial=trial)
    path = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    limit = args.save_total_limit
    try:
        if args.should_save:
            begin_save(path, trainer.precision)
        args.save_total_limit = None  # the stock save rotates right after trainer_state.json
        try:
            save(trial)
        finally:
            args.save_total_limit = limit
        crash_point("save-before-barrier")
        trainer.accelerator.wait_for_everyone()
        if args.should_save:
            crash_point("save-before-manifest")
            finish_save(path, trainer.precision, args.world_size)
    except Exception as err:
        raise failed_save(path, err) from err
    if args.should_save:
        crash_point("save-before-rotation")
        rotate_checkpoints(run_dir, limit, trainer.state.best_model_checkpoint, use_mtime=True)


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed; the message names the file, the cause and the intact checkpoint."""


def failed_save(path: str, error: BaseException) -> CheckpointSaveError:
    """The error to raise when the save of checkpoint `path` failed with `error`: the file being
    written and the cause (`write_failure`), and the last complete checkpoint beside it, which
    the save has not touched (older checkpoints are rotated only after a save completes)."""
    file, cause = write_failure(path, error, _checkpoint_files(path) if os.path.isdir(path) else [])
    previous = last_complete_checkpoint(os.path.dirname(path), exclude=path, quiet=True)
    kept = f"The previous checkpoint {previous} is intact" if previous else "No earlier complete checkpoint exists"
    where = f"while writing {file}" if file else f"in {path}"
    return CheckpointSaveError(
        f"saving checkpoint {path} failed {where}: {cause}. {kept}; {os.path.basename(path)} is incomplete and "
        "resume_from_checkpoint=True skips it. Free space or fix the permissions (or set output_dir elsewhere), "
        "then resume with resume_from_checkpoint=True"
    )


def parse_resume_reset(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """`resume_reset` ("optimizer,scheduler" or a list) as a tuple of part names; ValueError naming a bad one."""
    if value is None or value == "":
        return ()
    parts = value.split(",") if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, str) for p in parts):
        raise ValueError(f"resume_reset must be a comma-separated string or a list of names, got {value!r}")
    parts = tuple(p.strip() for p in parts if p.strip())
    unknown = sorted(set(parts) - set(RESETTABLE))
    if unknown:
        raise ValueError(
            f"resume_reset names {unknown}, which cannot be reset; valid parts: {', '.join(RESETTABLE)} "
            "(the weights and the trainer state are never reset)"
        )
    return parts


def _read_manifest(path: str) -> dict | None:
    try:
        return read_manifest(path)
    except ManifestError as err:
        raise _damaged(path, err.name, err.problem) from None


def _resettable_part(name: str) -> str | None:
    return next((part for part, pattern in _RESET_FILES.items() if pattern.match(name)), None)


def _verify_manifest(path: str, manifest: dict, reset: tuple[str, ...]) -> set[str]:
    """Check every listed file; the parts to start afresh (named in `reset`), or ValueError."""
    resets: set[str] = set()
    for rel, entry in sorted(manifest["files"].items()):
        problem = file_problem(path, rel, entry)
        if problem is None:
            continue
        file = os.path.join(path, rel)
        part = _resettable_part(rel)
        if part is not None and part in reset:
            state = problem if problem == "missing" else f"damaged ({problem})"
            logger.warning("%s is %s; resume_reset names %r: %s", file, state, part, RESETTABLE[part])
            resets.add(part)
            continue
        hint = (
            f", or resume from it without the file with resume_reset={part!r} (--resume_reset {part}): {RESETTABLE[part]}"
            if part is not None
            else ""
        )
        raise _damaged(path, rel, problem, hint)
    return resets


def _check_manifest_strategy(path: str, manifest: dict, strategy: Any) -> None:
    saved = manifest.get("strategy")
    name = strategy.name if strategy is not None else None
    if saved != name:
        _refuse_strategy(os.path.join(path, MANIFEST), path, saved, name)
    if strategy is not None and isinstance(manifest.get("options"), dict):
        strategy.check_resume_options(manifest["options"], os.path.join(path, MANIFEST))


def _check_world_size(path: str, manifest: dict, reset: tuple[str, ...]) -> set[str]:
    """Each process restores its own random generators (`rng_state_N.pth`): a resume with another
    number of processes would skip that silently (the stock Trainer only logs it at INFO level)."""
    saved = manifest.get("world_size", 1)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if saved == world:
        return set()
    if "rng" in reset:
        logger.warning(
            "%s was saved by %d processes, this run has %d; resume_reset names 'rng': %s",
            path,
            saved,
            world,
            RESETTABLE["rng"],
        )
        return {"rng"}
    raise ValueError(
        f"{path} was saved by {saved} processes, but this run has {world}: each process's random generators "
        f"(rng_state_N.pth) belong to its rank, and the data order follows the number of processes. Nothing was "
        f"loaded. Resume with {saved} processes, or pass resume_reset='rng' (--resume_reset rng): {RESETTABLE['rng']}"
    )


def check_checkpoint(path: str, strategy: Any = None, reset: tuple[str, ...] = ()) -> set[str]:
    """Raise ValueError unless `path` is a finished, undamaged checkpoint of `strategy`
    (a `PrecisionStrategy` or None); returns the parts of `reset` the resume must start afresh."""
    if not os.path.isdir(path):
        # The stock Trainer's refusal of this path, then ours.
        raise ValueError(
            f"Can't find a valid checkpoint at {path}: resume_from_checkpoint={path!r} is not a directory; "
            "pass a checkpoint-N directory or True"
        )
    reason = incomplete_reason(path)
    if reason is not None:
        # The stock Trainer fails opening a missing trainer_state.json: its exception and message first.
        state_file = os.path.join(path, TRAINER_STATE)
        missing = not os.path.isfile(state_file)
        stock = f"{FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), state_file)}: " if missing else ""
        raise (IncompleteCheckpointError if missing else ValueError)(
            f"{stock}{path} is an incomplete checkpoint ({reason}): its save was interrupted. "
            "Resume with resume_from_checkpoint=True (the last complete checkpoint) or pass an earlier one"
        )
    manifest = _read_manifest(path)
    if manifest is not None:
        resets = _verify_manifest(path, manifest, reset)
        _check_manifest_strategy(path, manifest, strategy)
        return resets | _check_world_size(path, manifest, reset)
    logger.warning(
        "%s has no %s (saved before checkpoints carried one): only truncation and archive CRCs are checked",
        path,
        MANIFEST,
    )
    _check_files(path)
    _check_strategy(path, strategy)
    return set()


def resolve_resume_checkpoint(
    output_dir: str, resume: str | bool | None, strategy: Any = None, reset: tuple[str, ...] = ()
) -> tuple[str | None, set[str]]:
    """The checkpoint directory `Trainer.train(resume_from_checkpoint=resume)` should load, checked
    (None for none), and the parts of the state the resume starts afresh (see `check_checkpoint`)."""
    if resume is None or resume is False:
        return None, set()
    if resume is True:
        path = last_complete_checkpoint(output_dir)
        if path is None:
            raise ValueError(
                f"No valid checkpoint found in output directory ({output_dir}): resume_from_checkpoint=True, but it "
                "holds no complete checkpoint-N directory; train without resume_from_checkpoint"
            )
    else:
        path = os.fspath(resume)
    return path, check_checkpoint(path, strategy, reset)
