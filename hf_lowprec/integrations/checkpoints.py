"""Which Trainer checkpoint a run resumes from, checked before any state changes.

The stock `transformers.Trainer` resumes (`resume_from_checkpoint=True`) from the highest
numbered `checkpoint-N` directory, whether or not its save finished: a run killed while it
wrote checkpoint N then either fails with a traceback from deep inside the loader or, worse,
loads N's new weights with no optimizer state. The Trainer writes `trainer_state.json` last
(after the weights, optimizer, scheduler and RNG states), so a checkpoint whose
`trainer_state.json` is missing or cut short is one whose save was interrupted: it is skipped,
with a warning. A finished checkpoint whose files are damaged, or that another precision
strategy saved, is refused with an error that names the file and what to do.

Every checkpoint the package's Trainer saves carries a manifest (`hf_lowprec_manifest.json`):
each file with its size and CRC-32, the precision strategy and its options. A resume checks
presence, sizes and checksums before anything is loaded. A missing or damaged optimizer,
scheduler or RNG file is refused unless the run names that part in `resume_reset`, which says
what starts afresh; anything else missing or damaged is always refused. A checkpoint without a
manifest (saved before manifests existed) gets the archive checks below and a one-line warning.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import zipfile
import zlib
from typing import Any

import torch

__all__ = [
    "MANIFEST",
    "IncompleteCheckpointError",
    "RESETTABLE",
    "incomplete_reason",
    "last_complete_checkpoint",
    "check_checkpoint",
    "parse_resume_reset",
    "resolve_resume_checkpoint",
    "write_manifest",
]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
MANIFEST = "hf_lowprec_manifest.json"
_MANIFEST_FORMAT = "hf_lowprec checkpoint manifest 1"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 1 << 20  # bytes read at a time while checksumming

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
    return None


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The highest-numbered finished `checkpoint-N` in `output_dir`; unfinished ones are skipped with a warning."""
    if not os.path.isdir(output_dir):
        return None
    numbered = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_DIR.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            numbered.append((int(match.group(1)), os.path.join(output_dir, name)))
    for _, path in sorted(numbered, reverse=True):
        reason = incomplete_reason(path)
        if reason is None:
            return path
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


def _checksum(file: str) -> int:
    """CRC-32 of `file`, read in 1 MiB chunks (about 1 GB/s on one core; docs/checkpoints.md)."""
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _checkpoint_files(path: str) -> list[str]:
    """Every file under `path` (DeepSpeed keeps its own in a sub-directory), relative, sorted."""
    found = []
    for root, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel != MANIFEST and not name.startswith(f"{MANIFEST}."):
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def write_manifest(path: str, strategy: Any = None) -> None:
    """Write `path`/hf_lowprec_manifest.json: each file's size and CRC-32, the strategy and its options.

    Written last, after the Trainer finished the checkpoint, and atomically (a temporary file
    renamed), so a manifest always describes complete files.
    """
    files = {}
    for rel in _checkpoint_files(path):
        file = os.path.join(path, rel)
        files[rel] = {"bytes": os.path.getsize(file), "crc32": _checksum(file)}
    options = dataclasses.asdict(strategy.options) if strategy is not None else None
    manifest = {
        "format": _MANIFEST_FORMAT,
        "strategy": strategy.name if strategy is not None else None,
        "options": options,
        "files": files,
    }
    temporary = os.path.join(path, f"{MANIFEST}.tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(path, MANIFEST))


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
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise _damaged(path, MANIFEST, f"unreadable: {err}") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != _MANIFEST_FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise _damaged(path, MANIFEST, f"not a {_MANIFEST_FORMAT!r} file")
    return manifest


def _resettable_part(name: str) -> str | None:
    return next((part for part, pattern in _RESET_FILES.items() if pattern.match(name)), None)


def _verify_manifest(path: str, manifest: dict, reset: tuple[str, ...]) -> set[str]:
    """Check every listed file; the parts to start afresh (named in `reset`), or ValueError."""
    resets: set[str] = set()
    for rel, entry in sorted(manifest["files"].items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            problem = "missing"
        elif os.path.getsize(file) != entry.get("bytes"):
            problem = f"{os.path.getsize(file)} bytes, the manifest lists {entry.get('bytes')}"
        elif _checksum(file) != entry.get("crc32"):
            problem = "its CRC-32 differs from the manifest's: overwritten since it was saved"
        else:
            continue
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
        return resets
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
