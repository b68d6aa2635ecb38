"""Which Trainer checkpoint a run resumes from, checked before any state changes.

The stock `transformers.Trainer` resumes (`resume_from_checkpoint=True`) from the highest
numbered `checkpoint-N` directory, whether or not its save finished: a run killed while it
wrote checkpoint N then either fails with a traceback from deep inside the loader or, worse,
loads N's new weights with no optimizer state. The Trainer writes `trainer_state.json` last
(after the weights, optimizer, scheduler and RNG states), so a checkpoint whose
`trainer_state.json` is missing or cut short is one whose save was interrupted: it is skipped,
with a warning. A finished checkpoint whose files are damaged, or that another precision
strategy saved, is refused with an error that names the file and what to do.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zipfile

import torch

__all__ = ["incomplete_reason", "last_complete_checkpoint", "check_checkpoint", "resolve_resume_checkpoint"]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


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


def _damaged(path: str, name: str, what: str) -> ValueError:
    return ValueError(
        f"checkpoint file {os.path.join(path, name)} is damaged ({what}). Nothing was loaded. "
        f"Delete {path} and resume with resume_from_checkpoint=True (the last complete checkpoint before it), "
        "or pass resume_from_checkpoint=<an earlier checkpoint directory>"
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


def _check_strategy(path: str, strategy: str | None) -> None:
    file = os.path.join(path, OPTIMIZER)
    if not os.path.isfile(file):  # DeepSpeed and sharded layouts keep their own optimizer files
        return
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    ours = state.get("hf_lowprec") if isinstance(state, dict) else None
    saved = ours.get("strategy") if isinstance(ours, dict) else None
    if saved == strategy:
        return
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


def check_checkpoint(path: str, strategy: str | None) -> None:
    """Raise ValueError unless `path` is a finished, undamaged checkpoint of `strategy`."""
    if not os.path.isdir(path):
        raise ValueError(f"resume_from_checkpoint={path!r} is not a directory; pass a checkpoint-N directory or True")
    reason = incomplete_reason(path)
    if reason is not None:
        raise ValueError(
            f"{path} is an incomplete checkpoint ({reason}): its save was interrupted. "
            "Resume with resume_from_checkpoint=True (the last complete checkpoint) or pass an earlier one"
        )
    _check_files(path)
    _check_strategy(path, strategy)


def resolve_resume_checkpoint(output_dir: str, resume: str | bool | None, strategy: str | None) -> str | None:
    """The checkpoint directory `Trainer.train(resume_from_checkpoint=resume)` should load, checked; None for none."""
    if resume is None or resume is False:
        return None
    if resume is True:
        path = last_complete_checkpoint(output_dir)
        if path is None:
            raise ValueError(
                f"resume_from_checkpoint=True, but {output_dir} holds no complete checkpoint-N directory; "
                "train without resume_from_checkpoint"
            )
    else:
        path = os.fspath(resume)
    check_checkpoint(path, strategy)
    return path
