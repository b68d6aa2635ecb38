"""Child processes that run autograd: `autograd_context()`, a fork where a forked child can
still run a backward, else a fork server (torch 2.14 refuses a backward in a child forked after
its parent ran one on fake tensors, as the planner's counts do). docs/planning.md, "Limits".
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from multiprocessing.context import BaseContext

import torch

__all__ = ["autograd_context", "fork_runs_autograd"]


def _backward_then_exit() -> None:
    try:
        x = torch.ones(1, requires_grad=True)
        (x * 2).sum().backward()
    except RuntimeError:  # "Unable to handle autograd's threading in combination with fork-based ..."
        os._exit(1)
    os._exit(0)


def fork_runs_autograd() -> bool:
    """Whether a child forked from this process now can run a backward (asked of one such child:
    a few milliseconds; the answer can turn from yes to no, never back)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    probe = multiprocessing.get_context("fork").Process(target=_backward_then_exit)
    probe.start()
    probe.join()
    return probe.exitcode == 0


def autograd_context(preload: Sequence[str] = ()) -> BaseContext:
    """The fork context if a forked child can run autograd (it pays no imports); else a fork server
    started clean, with the modules in `preload` imported once there, not in every child."""
    if fork_runs_autograd():
        return multiprocessing.get_context("fork")
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(list(preload))
    return server
