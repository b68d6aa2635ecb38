"""A build of the native kernels that was killed leaves torch's `lock` in its directory, and every
later `cpp_extension.load` waits on it for ever. `claim` waits for a live builder itself, clears a
lock whose builder is gone (its owner files name only dead processes of this host, or, with no owner
file, it is older than `STALE_AFTER_S`), and names this process the builder while it loads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["STALE_AFTER_S", "build_directory", "claim"]

logger = logging.getLogger(__name__)

# No owner file (a build by an older release, or by torch alone): a lock this old is left over. The
# build takes 2 to 3 minutes on two cores.
STALE_AFTER_S = 30 * 60
_PREFIX = "hf_lowprec-owner-"
_POLL_S = 0.5


def build_directory(name: str) -> Path:
    """Where `torch.utils.cpp_extension.load(name=...)` builds: `TORCH_EXTENSIONS_DIR`, else torch's default root."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _stale(directory: Path, host: str) -> bool:
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    owners = list(directory.glob(f"{_PREFIX}*"))
    if not owners:
        return age > STALE_AFTER_S
    for owner in owners:
        owner_host, _, pid = owner.name.removeprefix(_PREFIX).rpartition("-")
        if owner_host != host or not pid.isdigit() or _alive(int(pid)):
            return False  # a live builder (or one on another host): torch's wait is right
    return True


@contextlib.contextmanager
def claim(directory: Path) -> Iterator[None]:
    """Around `cpp_extension.load`: a stale lock is removed (with a warning), and this process is
    named the directory's builder until the load returns. An unwritable directory changes nothing."""
    host = socket.gethostname().replace("-", "_")
    mine = directory / f"{_PREFIX}{host}-{os.getpid()}"
    lock, told = directory / "lock", False
    try:
        while lock.exists():  # torch would wait for ever: wait here, where a gone builder is seen
            if _stale(directory, host):
                logger.warning("removing %s, left by a native-kernel build that was killed; building again", lock)
                lock.unlink(missing_ok=True)
                for owner in directory.glob(f"{_PREFIX}{host}-*"):
                    owner.unlink(missing_ok=True)
                break
            if not told:
                logger.warning("waiting for %s: another process builds the native kernels", lock)
                told = True
            time.sleep(_POLL_S)
        directory.mkdir(parents=True, exist_ok=True)
        mine.touch()
    except OSError:
        pass  # read-only or missing: torch's own load reports what it can
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            mine.unlink(missing_ok=True)
