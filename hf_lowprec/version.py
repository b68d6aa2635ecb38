"""The package's version, and the git commit it runs from, as checkpoints record them.

`__version__` goes up whenever an update rule or a state layout changes (docs/checkpoints.md,
"Resume rules"): a resume is bit for bit only within one version. The commit is read from the
checkout's `.git` files once per process (no subprocess); None for an installed package.
A resume checks the saving version once (`one_resume`): from the manifest where there is one,
else from the first state it loads; the warning is logged by the main process.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["VERSION_KEYS", "__version__", "git_commit", "one_resume", "saving_version", "warn_other_version"]

logger = logging.getLogger(__name__)

__version__ = "0.2.0"

VERSION_KEYS = ("hf_lowprec_version", "hf_lowprec_commit")  # in the manifest and the optimizer's "hf_lowprec" entry
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Inside `one_resume`: a list that holds True once this resume's version was checked.
_CHECKED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("hf_lowprec_version_checked", default=None)


@functools.cache
def git_commit() -> str | None:
    """The commit the package's git checkout is at (its HEAD), or None outside a checkout."""
    git = os.path.join(_ROOT, ".git")
    try:
        if os.path.isfile(git):  # a worktree: "gitdir: <path>"
            with open(git, encoding="utf-8") as f:
                git = os.path.join(_ROOT, f.read().strip().removeprefix("gitdir:").strip())
        with open(os.path.join(git, "HEAD"), encoding="utf-8") as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return head or None  # a detached HEAD holds the commit itself
        return _ref(git, head.removeprefix("ref:").strip())
    except OSError:
        return None


def _ref(git: str, ref: str) -> str | None:
    """The commit `ref` names: its loose file (in the worktree's or the common directory), else packed-refs."""
    places = [git]
    common = os.path.join(git, "commondir")
    if os.path.isfile(common):
        with open(common, encoding="utf-8") as f:
            places.append(os.path.join(git, f.read().strip()))
    for place in places:
        loose = os.path.join(place, ref)
        if os.path.isfile(loose):
            with open(loose, encoding="utf-8") as f:
                return f.read().strip() or None
    for place in places:
        packed = os.path.join(place, "packed-refs")
        if os.path.isfile(packed):
            with open(packed, encoding="utf-8") as f:
                for line in f:
                    commit, _, name = line.strip().partition(" ")
                    if name == ref:
                        return commit
    return None


def saving_version() -> dict[str, str | None]:
    """What a checkpoint records of the code that saved it: the version and the commit (or None)."""
    return {"hf_lowprec_version": __version__, "hf_lowprec_commit": git_commit()}


@contextlib.contextmanager
def one_resume() -> Iterator[None]:
    """One resume: inside it `warn_other_version` checks once, the first call deciding (the Trainer's
    check of the manifest, before anything loads), and the later ones (each state the resume
    loads: the optimizer's, each rank's, DeepSpeed's) say nothing. Nested, the outer one counts."""
    if _CHECKED.get() is not None:
        yield
        return
    token = _CHECKED.set([])
    try:
        yield
    finally:
        _CHECKED.reset(token)


def _main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def warn_other_version(saved: dict[str, Any], where: str) -> bool:
    """Log one warning (on the main process) when `saved` (a manifest, an optimizer state's "hf_lowprec"
    entry) was written by another version of the package than this one, or by one before 0.2.0 (no
    version recorded). Inside `one_resume` only its first call checks. Returns whether it warned."""
    checked = _CHECKED.get()
    if checked is not None:
        if checked:
            return False  # this resume's version was checked already
        checked.append(True)
    version = saved.get("hf_lowprec_version")
    if version == __version__ or not _main_process():
        return False
    commit, running = saved.get("hf_lowprec_commit"), git_commit()
    by = f"hf_lowprec {version}" if version else "an hf_lowprec version before 0.2.0 (it records no version)"
    logger.warning(
        "%s was saved by %s%s and is resumed by hf_lowprec %s%s: a resume continues bit for bit only within "
        "one version; where an update rule or a state layout changed between them (CHANGELOG.md) the run goes "
        "on, but not bit for bit as an uninterrupted run would",
        where,
        by,
        f" (commit {commit[:12]})" if commit else "",
        __version__,
        f" (commit {running[:12]})" if running else "",
    )
    return True
