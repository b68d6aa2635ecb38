"""Child processes that run autograd (`hf_lowprec.processes`): the answer to "can a forked child
run a backward?" is what a forked child finds, and the context returned runs a backward either way."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

from hf_lowprec import processes


def _double_grad(queue) -> None:
    x = torch.ones(3, requires_grad=True)
    (2 * x).sum().backward()
    queue.put(x.grad.tolist())


def _run_in(context) -> list[float]:
    queue = context.SimpleQueue()
    child = context.Process(target=_double_grad, args=(queue,))
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"the child's backward failed (exit code {child.exitcode})"
    return queue.get()


def test_the_probe_answers_what_a_forked_child_finds_after_a_backward_on_fake_tensors():
    """In a fresh interpreter: before and after a backward on fake tensors (torch 2.14 refuses a
    forked child's backward after it; earlier releases do not), `fork_runs_autograd` says what a
    forked child's own backward then does, and `autograd_context`'s child computes the gradient."""
    script = textwrap.dedent(
        """
        import json, multiprocessing, torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from hf_lowprec.processes import autograd_context, fork_runs_autograd
        from tests.test_processes import _double_grad, _run_in

        def backward_exit_code():
            fork = multiprocessing.get_context("fork")
            child = fork.Process(target=_double_grad, args=(fork.SimpleQueue(),))
            child.start()
            child.join(120)
            return child.exitcode

        seen = []
        for stage in ("fresh", "after a fake backward"):
            if stage != "fresh":
                with FakeTensorMode():
                    x = torch.ones(3, requires_grad=True)
                    (2 * x).sum().backward()
            context = autograd_context(["tests.test_processes"])
            seen.append([stage, fork_runs_autograd(), backward_exit_code() == 0,
                         context.get_start_method(), _run_in(context)])
        print(json.dumps(seen))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    for stage, probe, forked_child_ran, method, grad in seen:
        assert probe == forked_child_ran, (
            f"{stage}: the probe said {probe}, a forked child's backward ran: {forked_child_ran}"
        )
        assert method == ("fork" if probe else "forkserver"), stage
        assert grad == [2.0, 2.0, 2.0], stage
    assert seen[0][1], "a fresh process's forked child must run a backward"


def test_without_a_safe_fork_the_fork_server_runs_the_backward(monkeypatch):
    monkeypatch.setattr(processes, "fork_runs_autograd", lambda: False)
    context = processes.autograd_context([__name__])
    assert context.get_start_method() == "forkserver"
    assert _run_in(context) == [2.0, 2.0, 2.0]
