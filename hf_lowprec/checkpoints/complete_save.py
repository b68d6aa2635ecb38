"""The Trainer's checkpoints saved complete on every rank before older ones are rotated away.

The save is bracketed: `begin_save` writes a marker (`SAVE_MARKER`) before any file, and
`finish_save` writes the manifest (`hf_lowprec.checkpoints.manifest`) once every rank's files
exist, then removes the marker. So a checkpoint with the marker and no manifest is an interrupted
save, which a resume skips (`hf_lowprec.checkpoints.resume`); older ones are rotated away after
it. A failed write (or peer) is reported naming the file, the cause, the intact previous checkpoint
(`failed_save`); other errors rise as themselves. The export runs on every rank (`gather_export`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .manifest import MANIFEST, crash_point, peer_failure, save_failure, write_failure, write_manifest
from .resume import SAVE_MARKER, last_complete_checkpoint

__all__ = [
    "CheckpointSaveError",
    "save_complete_checkpoint",
    "begin_save",
    "finish_save",
    "failed_save",
    "gather_export",
    "with_export",
]


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


def finish_save(path: str, strategy: Any, world_size: int, model_only: bool = False) -> None:
    """Write the manifest of `path` (every rank's files must exist: call after a barrier), then drop the marker.
    `model_only`: saved with `save_only_model=True` (the weights alone: a resume refuses it unless told)."""
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
        **({"model_only": True} if model_only else {}),
        **acted,
    )
    marker = os.path.join(path, SAVE_MARKER)
    if os.path.exists(marker):
        os.remove(marker)


def save_complete_checkpoint(trainer: Any, save: Callable[[Any], None], trial: Any) -> None:
    """Run `save(trial)` (the stock `transformers.Trainer._save_checkpoint`) so that the checkpoint is complete
    on every rank before older ones are rotated away: the marker first, the stock save with its
    rotation held back, a barrier (every rank's RNG state and DeepSpeed partitions are written),
    the manifest, then the rotation (`save_total_limit`). A failed write (or a lost peer) is a
    `CheckpointSaveError` naming the file and the cause; any other error (a callback's, a
    `save_pretrained`'s) is raised as itself, as the stock Trainer raises it. Either way the
    marker stays and no manifest is written: a resume skips the checkpoint."""
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
            finish_save(path, trainer.precision, args.world_size, bool(getattr(args, "save_only_model", False)))
    except Exception as err:
        if not save_failure(err):
            _note_incomplete(err, path)
            raise
        raise failed_save(path, err) from err
    if args.should_save:
        crash_point("save-before-rotation")
        rotate_checkpoints(run_dir, limit, trainer.state.best_model_checkpoint, use_mtime=True)


def _note_incomplete(error: BaseException, path: str) -> None:
    """Tell, below `error`'s own message, that the save of `path` it stopped is skipped by a resume."""
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(
            f"hf_lowprec: checkpoint {path} is incomplete (this error stopped its save); "
            "resume_from_checkpoint=True skips it."
        )


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed; the message names the file, the cause and the intact checkpoint."""


def failed_save(path: str, error: BaseException) -> CheckpointSaveError:
    """The error to raise when the save of checkpoint `path` failed with `error`: the file being
    written and the cause (`write_failure`), and the last complete checkpoint beside it, which
    the save has not touched (older checkpoints are rotated only after a save completes)."""
    file, cause = write_failure(path, error, _checkpoint_files(path) if os.path.isdir(path) else [])
    previous = last_complete_checkpoint(os.path.dirname(path), exclude=path, quiet=True)
    kept = f"The previous checkpoint {previous} is intact" if previous else "No earlier complete checkpoint exists"
    where = f" while writing {file}" if file else "" if peer_failure(error) else " (the error names no file)"
    fix = (
        "Restart every process of the job"
        if peer_failure(error)
        else "Free space or fix the permissions (or set output_dir elsewhere)"
    )
    return CheckpointSaveError(
        f"saving checkpoint {path} failed{where}: {cause}. {kept}; {os.path.basename(path)} is incomplete and "
        f"resume_from_checkpoint=True skips it. {fix}, then resume with resume_from_checkpoint=True"
    )


def gather_export(precision: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    """What the strategy's export (`exported_state_dict`) puts in place of the model's own
    weights, by name (None: the weight is saved as the model holds it). A collective: every rank
    calls it, where transformers before 5.23 calls the Trainer's `_save` under DeepSpeed on the
    saving rank only (a gather there waited forever for the others)."""
    names = dict.fromkeys(name for name, _ in model.named_parameters(remove_duplicate=False))
    return precision.exported_state_dict(model, optimizer, names)


def with_export(precision: Any, model: Any, optimizer: Any, state_dict: Any, exported: Any) -> Any:
    """`state_dict` (None: the model's own) as the strategy exports it: with the weights
    `gather_export` gathered (`exported`), or, given None, gathered now (every rank calls it)."""
    if exported is None:
        return precision.exported_state_dict(model, optimizer, state_dict)
    state_dict = model.state_dict() if state_dict is None else state_dict
    return {**state_dict, **{k: v for k, v in exported.items() if v is not None and k in state_dict}}
