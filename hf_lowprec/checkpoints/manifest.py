"""A checkpoint's manifest: every file with its size and CRC-32, written last and atomically.

The Trainer's checkpoints (`hf_lowprec.checkpoints.resume`) and FSDP2's sharded ones
(`hf_lowprec.checkpoints.sharded`) carry one `hf_lowprec_manifest.json`; this
module writes it, reads it back with every field checked (a damaged entry is a `ManifestError`
naming it, never an `AttributeError` deep in a check), tells what is wrong with a listed
file and why a save failed to write (`write_failure`). Also the test-only stop point
`crash_point`, which ends a rank at a named stage of a save (no reliance on timing).
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist

from ..version import VERSION_KEYS, saving_version

__all__ = [
    "MANIFEST",
    "ENV_CRASH_AT",
    "ManifestError",
    "checksum",
    "crash_point",
    "file_entry",
    "file_problem",
    "read_manifest",
    "peer_failure",
    "save_failure",
    "write_failure",
    "write_manifest",
]

MANIFEST = "hf_lowprec_manifest.json"
MANIFEST_FORMAT = "hf_lowprec checkpoint manifest 1"
_CHUNK = 1 << 20  # bytes read at a time while checksumming
_CRC_LIMIT = 1 << 32

# Test-only: "stage" or "stage@rank" ends that rank at `crash_point(stage)` with os._exit.
ENV_CRASH_AT = "HF_LOWPREC_TEST_CRASH_AT"
CRASH_EXIT = 75


class ManifestError(ValueError):
    """`hf_lowprec_manifest.json` (or a file it lists) cannot be trusted; `problem` says why."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name}: {problem}")
        self.name = name
        self.problem = problem


def checksum(file: str) -> int:
    """CRC-32 of `file`, read in 1 MiB chunks (about 1 GB/s on one core; docs/checkpoints.md)."""
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_entry(file: str) -> dict[str, int]:
    return {"bytes": os.path.getsize(file), "crc32": checksum(file)}


def write_manifest(directory: str, files: Iterable[str] | Mapping[str, dict], **fields: Any) -> None:
    """Write `directory`/hf_lowprec_manifest.json: `fields`, the saving version and commit, and each
    file's size and CRC-32.

    `files` are paths relative to `directory` (checksummed here), or entries already formed
    (each rank's own files, checksummed by that rank). Written through a temporary file that
    is synced and renamed, so a manifest always describes complete files.
    """
    if not isinstance(files, Mapping):
        files = {rel: file_entry(os.path.join(directory, rel)) for rel in files}
    manifest = {"format": MANIFEST_FORMAT, **saving_version(), **fields, "files": dict(sorted(files.items()))}
    temporary = os.path.join(directory, f"{MANIFEST}.tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(directory, MANIFEST))


def read_manifest(directory: str) -> dict | None:
    """The manifest of `directory` with every field checked; None when there is none."""
    file = os.path.join(directory, MANIFEST)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ManifestError(MANIFEST, f"unreadable: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ManifestError(MANIFEST, f"not a {MANIFEST_FORMAT!r} file")
    problem = _field_problem(manifest)
    if problem is not None:
        raise ManifestError(MANIFEST, problem)
    return manifest


def _field_problem(manifest: dict) -> str | None:
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f"its files are {_shown(files)}, not an object of entries"
    for rel, entry in files.items():
        problem = _entry_problem(rel, entry)
        if problem is not None:
            return f"entry {rel!r} {problem}"
    strategy, options = manifest.get("strategy"), manifest.get("options")
    if strategy is not None and not isinstance(strategy, str):
        return f"its strategy is {_shown(strategy)}, not a name or null"
    if options is not None and not isinstance(options, dict):
        return f"its options are {_shown(options)}, not an object or null"
    for key in VERSION_KEYS:
        if manifest.get(key) is not None and not isinstance(manifest[key], str):
            return f"its {key} is {_shown(manifest[key])}, not a string or null"
    world = manifest.get("world_size", 1)
    if type(world) is not int or world < 1:
        return f"its world_size is {_shown(world)}, not a positive integer"
    return None


def _entry_problem(rel: str, entry: Any) -> str | None:
    parts = rel.split("/")
    if not rel or rel.startswith("/") or ".." in parts or "\\" in rel:
        return "is not a path inside the checkpoint"
    if not isinstance(entry, dict):
        return f'is {_shown(entry)}, not {{"bytes": <int>, "crc32": <int>}}'
    for field, limit in (("bytes", None), ("crc32", _CRC_LIMIT)):
        value = entry.get(field)
        if type(value) is not int or value < 0 or (limit is not None and value >= limit):
            bound = "an integer in [0, 2^32)" if limit is not None else "a non-negative integer"
            return f"has {field} {_shown(value)}, not {bound}"
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def file_problem(directory: str, rel: str, entry: dict) -> str | None:
    """What is wrong with listed file `rel` ("missing", a size or checksum mismatch), or None."""
    file = os.path.join(directory, rel)
    if not os.path.isfile(file):
        return "missing"
    size = os.path.getsize(file)
    if size != entry["bytes"]:
        return f"{size} bytes, the manifest lists {entry['bytes']}"
    if checksum(file) != entry["crc32"]:
        return "its CRC-32 differs from the manifest's: overwritten since it was saved"
    return None


_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "the filesystem is read-only",
    errno.EFBIG: "the file exceeds the size this process may write",
}


PEER_STOPPED = "another process stopped"
# How a collective whose peer died fails where torch raises no DistError (gloo through functional
# collectives, NCCL's watchdog): a RuntimeError naming the backend or the lost connection.
_PEER_MARKS = (
    "[gloo",
    "Connection reset by peer",
    "Connection closed by peer",
    "NCCL communicator was aborted",
    "ncclRemoteError",
)


def peer_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another process stopped."""
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(mark in str(error) for mark in _PEER_MARKS)
    )


# How torch's archive writer and safetensors report a failed write: an error that is no OSError.
_WRITER_MARKS = ("unexpected pos", "PytorchStreamWriter failed", "file write failed", "I/O error")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # safetensors' (Rust's) errno, in its message


def save_failure(error: BaseException) -> bool:
    """Whether `error` is a failed write of a checkpoint's files (an OSError, or torch's archive
    writer's or safetensors' report of one) or another process's failure: what a failed save
    reports as such. Anything else (a callback's or a `save_pretrained`'s own error) is no
    fault of the disk."""
    if isinstance(error, OSError) or peer_failure(error):
        return True
    writer = isinstance(error, RuntimeError) or type(error).__name__ == "SafetensorError"
    return writer and any(mark in str(error) for mark in _WRITER_MARKS)


def write_failure(directory: str, error: BaseException, files: list[str]) -> tuple[str | None, str]:
    """(the file being written, the cause) of a save into `directory` that failed with `error`, a
    `save_failure`.

    The file is the error's own. Where it names none (torch's archive writer, safetensors, a
    plain write), the newest of `files` (relative to `directory`) when writing one more byte to
    it (cut off again) fails too; else None: not known. The cause is the error's errno (in
    safetensors' message), else the probe's, else the error and the free space of the filesystem.
    """
    file = getattr(error, "filename", None)
    if peer_failure(error):
        return file, f"{PEER_STOPPED} during the save ({type(error).__name__}: {error})"
    code = getattr(error, "errno", None)
    if code is None and (found := _OS_ERROR.search(str(error))):
        code = int(found.group(1))
    if file is None:
        newest = max(
            (os.path.join(directory, rel) for rel in files), key=lambda f: os.lstat(f).st_mtime_ns, default=None
        )
        probed = _write_probe(newest) if newest is not None and os.path.isfile(newest) else None
        if probed is not None:
            file, code = newest, code if code is not None else probed
    if code is not None:
        return file, f"{_CAUSES.get(code, os.strerror(code))} ({errno.errorcode.get(code, code)})"
    cause = f"{type(error).__name__}: {error}"
    try:
        stats = os.statvfs(directory)
    except OSError:
        return file, cause
    return file, f"{cause}; {stats.f_bavail * stats.f_frsize} bytes free on its filesystem"


def _write_probe(file: str) -> int | None:
    """The errno of appending one byte to `file` (cut off again), or None when it can be written."""
    try:
        with open(file, "r+b") as f:
            end = f.seek(0, os.SEEK_END)
            f.write(b"\0")
            f.flush()
            os.fsync(f.fileno())
            f.truncate(end)
    except OSError as probe:
        return probe.errno
    return None


def crash_point(stage: str) -> None:
    """Test-only: end this process at `stage` of a save when $HF_LOWPREC_TEST_CRASH_AT names it.

    The value is `stage` (every rank) or `stage@rank`. The process ends with os._exit, as a
    SIGKILL would leave it: no cleanup, no flush of Python buffers.
    """
    wanted = os.environ.get(ENV_CRASH_AT)
    if not wanted:
        return
    name, _, rank = wanted.partition("@")
    if name != stage or (rank and int(rank) != _rank()):
        return
    sys.stderr.write(f"{ENV_CRASH_AT}: rank {_rank()} ends at {stage!r}\n")
    sys.stderr.flush()
    os._exit(CRASH_EXIT)


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
