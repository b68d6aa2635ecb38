"""Every check before a resume, and every refusal of one: where a resume is refused, it is here.

`checked_resume` is the Trainer's one call: which checkpoint (an interrupted save is skipped),
its files against the manifest, the strategy, its options, the number of processes; `resume_reset`
names the parts that may start afresh. The same checks serve a strategy's state in an optimizer's
state dict (`check_optimizer_state`, `check_fp8_layout`), FSDP2's sharded checkpoints, FP8-LM's
ZeRO state (`check_zero_owners`); docs/checkpoints.md. Long because every refusal is raised here.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import json
import logging
import os
import re
import weakref
import zipfile
from typing import Any

import torch

from ..version import warn_other_version
from .manifest import MANIFEST, ManifestError, file_problem, read_manifest

__all__ = [
    "MANIFEST",
    "IncompleteCheckpointError",
    "SAVE_MARKER",
    "RESETTABLE",
    "checked_resume",
    "incomplete_reason",
    "last_complete_checkpoint",
    "check_checkpoint",
    "check_saved_manifest",
    "check_accelerate_state",
    "check_resume_options",
    "check_optimizer_state",
    "check_stock_optimizer_state",
    "refuse_split_fp8_groups",
    "check_fp8_layout",
    "check_split_schedule",
    "check_zero_owners",
    "refuse_rank_optimizers",
    "refuse_strategy_checkpoint",
    "sharded_checkpoint_problem",
    "parse_resume_reset",
    "resolve_resume_checkpoint",
]

logger = logging.getLogger(__name__)
# strategy → the option changes it has logged: the manifest's check and the optimizer state's
# load read the same saved options, and the change is said once.
_CHANGES_LOGGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# The stock resume takes the highest numbered checkpoint, finished or not. The Trainer writes
# trainer_state.json last, so one missing or cut short is an interrupted save; so is hf_lowprec's
# marker without a manifest (complete_save.py writes the marker first and the manifest last).
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
        check_resume_options(strategy, ours["options"], file)
    if isinstance(ours, dict):
        warn_other_version(ours, file)


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


def parse_resume_reset(value: str | list[str] | tuple[str, ...] | None, with_strategy: bool = True) -> tuple[str, ...]:
    """`resume_reset` ("optimizer,scheduler" or a list) as a tuple of part names; ValueError naming a bad
    one, or any, `with_strategy=False`: without a strategy the Trainer resumes as the stock one, and
    there is no manifest and nothing to reset."""
    if value and not with_strategy:
        raise ValueError("resume_reset was given without precision_strategy; set --precision_strategy")
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


def _check_model_only(path: str, manifest: dict, reset: tuple[str, ...]) -> set[str]:
    """A checkpoint saved with `save_only_model=True` holds the weights alone: its manifest lists
    no optimizer, scheduler or RNG file, so `_verify_manifest` finds none missing, and a resume would
    start them afresh without a word. Refused unless `reset` names all three. A manifest written
    before it carried `model_only` tells it by its files: every full save writes an RNG state."""
    files = manifest.get("files", {})
    if not manifest.get("model_only") and any(_RESET_FILES["rng"].match(f) for f in files):
        return set()
    parts = ("optimizer", "scheduler", "rng")
    if any(part not in reset for part in parts):
        raise ValueError(
            f"{path} was saved with save_only_model=True: it holds the weights only, so a resume from it would "
            f"start afresh the optimizer ({RESETTABLE['optimizer']}), the schedule and the random generators. "
            "Nothing was loaded. Resume from a checkpoint saved without save_only_model, or start them afresh "
            "knowingly with resume_reset='optimizer,scheduler,rng' (--resume_reset optimizer,scheduler,rng)"
        )
    for part in parts:
        logger.warning(
            "%s was saved with save_only_model=True; resume_reset names %r: %s", path, part, RESETTABLE[part]
        )
    return set(parts)


def _check_manifest_strategy(path: str, manifest: dict, strategy: Any) -> None:
    saved = manifest.get("strategy")
    name = strategy.name if strategy is not None else None
    if saved != name:
        _refuse_strategy(os.path.join(path, MANIFEST), path, saved, name)
    if strategy is not None and isinstance(manifest.get("options"), dict):
        check_resume_options(strategy, manifest["options"], os.path.join(path, MANIFEST))


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
    (a strategy object or None); returns the parts of `reset` the resume must start afresh, and warns
    once where another version saved it (`warn_other_version`). Without a manifest (saved before
    checkpoints carried one) only the archives are checked, with a warning."""
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
        resets = _verify_manifest(path, manifest, reset) | _check_model_only(path, manifest, reset)
        _check_manifest_strategy(path, manifest, strategy)
        resets |= _check_world_size(path, manifest, reset)
        warn_other_version(manifest, f"checkpoint {path}")  # the optimizer's load (if any) then says nothing
        return resets
    logger.warning(
        "%s has no %s (saved before checkpoints carried one): only truncation and archive CRCs are checked",
        path,
        MANIFEST,
    )
    _check_files(path)
    _check_strategy(path, strategy)
    return set()


def check_saved_manifest(path: str, strategy: Any) -> dict | None:
    """The manifest of a save outside the Trainer (`accelerator.save_state`), every file it lists
    checked and its strategy and options against `strategy` (ValueError, nothing loaded); None where
    there is none. The caller checks what its engine needs of the number of processes."""
    manifest = _read_manifest(path)
    if manifest is not None:
        _verify_manifest(path, manifest, ())
        _check_manifest_strategy(path, manifest, strategy)
    return manifest


def resolve_resume_checkpoint(
    output_dir: str, resume: str | bool | None, strategy: Any = None, reset: tuple[str, ...] = ()
) -> tuple[str | None, set[str]]:
    """The checkpoint directory `transformers.Trainer.train(resume_from_checkpoint=resume)` should load, checked
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


def checked_resume(output_dir: str, resume: Any, strategy: Any, resume_reset: Any) -> tuple[Any, set[str]]:
    """What `transformers.Trainer.train(resume_from_checkpoint=resume)` goes on with, after every check, and the
    parts of the state it starts afresh: the Trainer's one call before it loads anything.

    Under a strategy: `resolve_resume_checkpoint` with the parts `resume_reset` names. Without one
    (`strategy` None) the stock resume keeps its checks and errors and `resume` goes on unchanged;
    only a checkpoint a strategy saved is refused (`refuse_strategy_checkpoint`)."""
    if strategy is None:
        refuse_strategy_checkpoint(output_dir, resume)
        return resume, set()
    return resolve_resume_checkpoint(output_dir, resume, strategy, parse_resume_reset(resume_reset))


def refuse_strategy_checkpoint(output_dir: str, resume: Any) -> None:
    """Without a strategy: refuse the checkpoint a strategy saved (its manifest names the strategy);
    a stock checkpoint (no manifest) goes untouched to the stock resume, its checks and errors."""
    from transformers.trainer_utils import get_last_checkpoint

    if resume is True:
        resume = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if not isinstance(resume, (str, os.PathLike)):
        return
    try:
        manifest = read_manifest(os.fspath(resume))
    except (ManifestError, OSError):
        return  # not a manifest the package can read: the stock resume decides
    saved = manifest.get("strategy") if manifest is not None else None
    if saved is not None:
        raise ValueError(
            f"{os.path.join(resume, MANIFEST)} was saved by precision strategy {saved!r}, but this run uses no "
            f"precision strategy; resume with --precision_strategy {saved}, or start a new run from the weights "
            f"in {resume} without resume_from_checkpoint"
        )


# --- the strategy's own state, wherever it is loaded ------------------------------------------


def check_resume_options(strategy: Any, saved: dict[str, Any], where: str) -> list[str]:
    """Compare `strategy`'s options with the `saved` ones (read from `where`).

    Raises ValueError naming each changed option outside the strategy's `resume_safe_options`
    with its saved value; returns the safe options that changed, which the resumed run applies.
    """
    current = dataclasses.asdict(strategy.options)
    # An option this run never reads (e.g. group_size with states=False) cannot change its state.
    unread = strategy.options.unread_options() if hasattr(strategy.options, "unread_options") else {}
    # A seed left to the run (None) continues the saved stream, whatever seed drew it.
    changed = sorted(
        k
        for k in current.keys() | saved.keys()
        if current.get(k) != saved.get(k) and k not in unread and not (k == "seed" and current.get(k) is None)
    )
    refused = [k for k in changed if k not in strategy.resume_safe_options]
    if refused:
        listed = ", ".join(f"{k}={current.get(k)!r} (saved: {saved.get(k)!r})" for k in refused)
        keep = {k: saved[k] for k in refused if k in saved}
        raise ValueError(
            f"{where} was saved by precision strategy {strategy.name!r} with other options; this run changes "
            f"{listed}, which decide the layout and meaning of the saved state. Resume with the saved values "
            f"(precision_options {json.dumps(keep)}), or start a new run from the checkpoint's weights "
            "without resume_from_checkpoint"
        )
    logged = _CHANGES_LOGGED.setdefault(strategy, set())
    for k in changed:
        change = (k, repr(current.get(k)), repr(saved.get(k)))
        if change not in logged:
            logged.add(change)
            logger.info("resuming with %s=%r (saved: %r): applied from here on", k, current.get(k), saved.get(k))
    return changed


def check_optimizer_state(strategy: Any, saved: dict[str, Any]) -> list[str]:
    """The strategy's part of an optimizer's state dict (its "hf_lowprec" entry) against `strategy`:
    ValueError for another strategy's state or changed options (`check_resume_options`); returns
    the resume-safe options that changed."""
    name = saved.get("strategy")
    if name is not None and name != strategy.name:
        raise ValueError(
            f"this optimizer state was saved by precision strategy {name!r}, "
            f"not {strategy.name!r}; resume with --precision_strategy {name}"
        )
    options = saved.get("options")
    return check_resume_options(strategy, options, "this optimizer state") if options else []


def check_split_schedule(counts: list[int] | None, saved: int, live: int, schedule_file: str, state_file: str) -> None:
    """A `scheduler.pt` over `saved` param groups where the optimizer has `live` (fewer) is only
    resumed from FP8-LM O2's older split layout (`optim.fp8_adamw.split_group_counts` gave `counts`
    for `state_file`); any other is refused before anything is loaded."""
    if counts is None or sum(counts) != saved:
        raise ValueError(
            f"{schedule_file} holds an LR schedule over {saved} parameter groups and this run's optimizer has "
            f"{live}, and {state_file} is not FP8-LM O2's older split layout that merges into them (nothing was "
            f"loaded): resume with resume_reset='scheduler' to start the schedule afresh, or finish the run with "
            f"the hf_lowprec version that saved it (docs/checkpoints.md)"
        )


def check_stock_optimizer_state(strategy: Any, sharded: bool = False) -> None:
    """An optimizer state dict with no "hf_lowprec" entry (saved without a precision strategy) loaded
    into `strategy`'s optimizer: a strategy that trains with the user's optimizer (`takes_user_optimizer`)
    loads its stock layout, its own state starting afresh (a warning); any other refuses it. `sharded`
    (FSDP2): torch's optimizer state dict, as Accelerate saves it, keeps only the state and groups."""
    if sharded:
        logger.warning(
            "this FSDP2 optimizer state has no 'hf_lowprec' entry (torch's sharded optimizer state dict keeps the "
            "state and groups only): they load, and the state of precision strategy %r itself (skipped-step count, "
            "loss scale, FP8 gradient scale) starts afresh; the Trainer keeps it in its rank files",
            strategy.name,
        )
        return
    if strategy.takes_user_optimizer:
        logger.warning(
            "this optimizer state has no 'hf_lowprec' entry (saved without a precision strategy): its AdamW state "
            "loads, and the state of precision strategy %r itself (skipped-step count, loss scale) starts afresh",
            strategy.name,
        )
        return
    raise ValueError(
        "this optimizer state has no 'hf_lowprec' entry: it was saved without a precision strategy (a stock "
        "optimizer's state_dict, as accelerator.save_state writes in a loop without PrecisionPlugin), and precision "
        f"strategy {strategy.name!r} lays out its optimizer's state otherwise and keeps state of its own. None of it was "
        "loaded into the optimizer. Resume it without a precision strategy, or start this strategy's optimizer afresh from the "
        "checkpoint's weights: load only the model (its model.safetensors), not the optimizer state"
    )


def refuse_split_fp8_groups(saved_groups: int, live_groups: list[dict[str, Any]]) -> None:
    """A sharded optimizer state (FSDP2) saved when FP8-LM's optimizer split each group in two (FP8
    GEMM weights, then the rest): its states are numbered in that order, which a sharded load cannot
    renumber (a plain `load_state_dict` does: `optim.fp8_adamw.merge_split_groups`). Refused."""
    if saved_groups > len(live_groups) and any(g.get("unscaled_format") is not None for g in live_groups):
        raise ValueError(
            f"this sharded optimizer state holds {saved_groups} parameter groups for the optimizer's "
            f"{len(live_groups)}: an earlier hf_lowprec's fp8-lm optimizer split each group in two, and its states are "
            "numbered in that order, which a sharded resume cannot renumber. Nothing was loaded. Resume it with the "
            "version that saved it, or continue from its weights with a fresh optimizer (resume_reset=['optimizer'])"
        )


def check_fp8_layout(strategy: Any, saved: dict[str, Any]) -> None:
    """The layers the FP8 layer rule kept in BF16 (`strategy.fp8_layout`) against those recorded in
    an optimizer state's "hf_lowprec" entry (none recorded: saved before the rule, every layer
    FP8). Another set of FP8 layers lays the optimizer's state out differently: ValueError naming
    the layers and the options that convert them as saved."""
    current = getattr(strategy, "fp8_layout", None)
    if current is None:
        return
    layout = saved.get("fp8_layout") or {"gpu": "", "tokens": 0, "kept": []}
    if sorted(layout["kept"]) == sorted(current["kept"]):
        return
    fix = (
        {"fp8_gpu": layout["gpu"], "fp8_tokens": layout["tokens"]}
        if layout["kept"] and layout["gpu"]
        else {"fp8_layers": "all"}
    )
    differ = sorted(set(layout["kept"]) ^ set(current["kept"]))
    raise ValueError(
        f"this optimizer state was saved with {len(layout['kept'])} layers kept in BF16 by the FP8 layer rule "
        f"({layout['gpu'] or 'no GPU priced'}), and this run keeps {len(current['kept'])} "
        f"({current['gpu'] or 'no GPU priced'}): {', '.join(differ[:4])}{' …' if len(differ) > 4 else ''} "
        f"would change between FP8 and BF16, and their state with them. Resume with precision_options "
        f"{json.dumps(fix)}, which converts the layers as saved"
    )


def check_zero_owners(saved: Any, owners: list[int]) -> None:
    """FP8-LM's ZeRO state loads where each tensor has the owner rank it was saved with."""
    if list(saved) != owners:
        raise ValueError(
            f"this FP8 ZeRO state was saved with tensor owners {saved}, this run assigns "
            f"{owners}; resume with the same number of ranks"
        )


def refuse_rank_optimizers(checkpoint: str, saved: int, world: int) -> None:
    """A Trainer's FSDP2 checkpoint holds each of `saved` processes' optimizer state; `world` differ."""
    raise ValueError(
        f"{checkpoint} holds the optimizer state of each of its {saved} processes (FSDP2: the strategy's state laid "
        f"out per shard, which another number of processes cannot split), but this run has {world}. Nothing was "
        f"loaded. Resume with {saved} processes, or pass resume_reset='optimizer' (--resume_reset optimizer): "
        f"{RESETTABLE['optimizer']}"
    )


# --- FSDP2's sharded checkpoints --------------------------------------------------------------


def sharded_checkpoint_problem(path: str, per_shard_state: bool, rank: int, world: int) -> str | None:
    """Why `world` ranks cannot load the sharded checkpoint `path` (this `rank` checks its share of
    the files), or None. Every rank refuses together: `hf_lowprec.checkpoints.sharded.check_saved`
    gathers what each found. State laid out per shard loads at the world size it was saved at only."""
    previous = f"{path}.previous"
    if not os.path.isdir(path) and os.path.isdir(previous):
        return (
            f"sharded checkpoint {path} is missing, and {previous} holds the previous complete save (a save "
            f"stopped between its two renames). Nothing was loaded. Rename {previous} to {path} to load it"
        )
    if not os.path.isdir(path):
        return f"sharded checkpoint {path} does not exist. Nothing was loaded"
    try:
        manifest = read_manifest(path)
    except ManifestError as err:
        return f"sharded checkpoint file {os.path.join(path, err.name)} is damaged ({err.problem})"
    if manifest is None:
        logger.warning("%s has no hf_lowprec_manifest.json (saved before checkpoints carried one): not checked", path)
        return None
    saved = manifest.get("world_size", 1)
    if (per_shard_state or manifest.get("per_shard_state")) and saved != world:
        return (
            f"sharded checkpoint {path} was saved by {saved} ranks and this run has {world}: its optimizer state "
            f"is laid out per shard (groups or blocks padded per rank), which cannot be resharded. Nothing was "
            f"loaded. Load it with {saved} ranks (torchrun --nproc_per_node {saved})"
        )
    for index, (rel, entry) in enumerate(sorted(manifest["files"].items())):
        what = file_problem(path, rel, entry) if index % world == rank else None
        if what is not None:
            what = what if what == "missing" else f"damaged ({what})"
            return (
                f"sharded checkpoint file {os.path.join(path, rel)} is {what}. Nothing was loaded. "
                "Load an earlier save, or save again from a run that holds this state"
            )
    return None


def check_accelerate_state(strategy: Any, path: str, world: int, engine: str) -> dict | None:
    """Refuse, before anything loads, what Accelerate's save_state wrote that this run cannot load (an
    interrupted save, a damaged file, another strategy or options, another number of processes where the state is
    each rank's: DeepSpeed's partitions, FSDP2's rank files); warn once where another version saved it.
    Returns the manifest (None: saved without one, which loads as Accelerate loads it)."""
    manifest = check_saved_manifest(path, strategy)
    if manifest is None:
        if os.path.isfile(os.path.join(path, SAVE_MARKER)):
            raise ValueError(
                f"{path} is an incomplete save: {SAVE_MARKER} is there and {MANIFEST} is not (a process stopped "
                "inside accelerator.save_state). Nothing was loaded. Load an earlier save, or save again"
            )
        return None
    saved = manifest.get("world_size", 1)
    per_rank = engine == "DEEPSPEED" or glob.glob(
        os.path.join(glob.escape(path), "hf_lowprec_optimizer*.rank*-of-*.pt")
    )
    if saved != world and per_rank:
        what = "DeepSpeed's optimizer partitions" if engine == "DEEPSPEED" else "each rank's optimizer state (FSDP2)"
        raise ValueError(
            f"{path} was saved by {saved} processes, but this run has {world}: it holds {what}, laid out per rank, "
            f"which another number of processes cannot split. Nothing was loaded. Load it with {saved} processes "
            f"(accelerate launch --num_processes {saved}, torchrun --nproc_per_node {saved})"
        )
    warn_other_version(manifest, f"checkpoint {path}")  # the optimizer's load then says nothing
    return manifest
