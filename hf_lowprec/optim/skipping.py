"""Skipped steps decided on the device: the found-inf flag, the step counts, the select.

`adamw.AdamW.step(found_inf=flag)` takes a loss scaler's overflow flag as a 0-dim floating tensor
on the parameters' device; nonzero (inf and NaN included) skips the step. Nothing reads it on the
host (no `.item()`, no sync), and θ, every state and the step count stay as they were.
"""

from __future__ import annotations

from typing import Any

import torch

from .scalars import device_scalar_rows, scalar_rows

__all__ = ["FlagPerDevice", "StepCounts", "check_found_inf", "select_", "step_count_on_device"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_found_inf(owner: str, found_inf: object) -> None:
    """Raise naming what a found-inf flag must be (its metadata only: no host sync)."""
    if found_inf is None:
        return
    if not torch.is_tensor(found_inf) or found_inf.numel() != 1 or not found_inf.is_floating_point():
        if torch.is_tensor(found_inf):
            described = f"a {found_inf.dtype} tensor of shape {tuple(found_inf.shape)}"
        else:
            described = repr(found_inf)
        raise TypeError(
            f"{owner}.step: found_inf must be a 0-dim floating tensor on the parameters' device "
            f"(nonzero skips the step), got {described}; pass e.g. torch.zeros((), device=param.device)"
        )


def step_count_on_device(state: dict[str, Any], device: torch.device) -> None:
    """A state that has taken no step gets its count in the form a strategy's step leaves it (each
    step of a strategy's optimizer takes a found-inf flag): what a sharded checkpoint loads into."""
    if not torch.is_tensor(state.get("step")) and state.get("step", 0) == 0:
        state["step"] = torch.zeros((), dtype=torch.float64, device=device)


def select_(original: torch.Tensor, skip: torch.Tensor, stepped: torch.Tensor) -> None:
    """original ← skip ? original : stepped, bit for bit (on integer views: any dtype, NaN payloads kept).

    The reference and compiled steps run into copies and keep the old bits with one such
    `torch.where` per stored tensor (fused into the loop when compiled); the native kernels read
    the flag once and return before writing anything."""
    bits = _BITS[original.element_size()]
    original.view(bits).copy_(torch.where(skip, original.view(bits), stepped.view(bits)))


class FlagPerDevice:
    """The found-inf flag as a 0-dim tensor on each device asked for (moved once per step)."""

    def __init__(self, found_inf: torch.Tensor | None):
        self.found_inf = found_inf
        self.moved: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor | None:
        flag = self.found_inf
        if flag is None:
            return None
        if flag.device == device:
            return flag.reshape(())
        if device not in self.moved:
            self.moved[device] = flag.reshape(()).to(device)
        return self.moved[device]


class StepCounts:
    """The step counts of a bucket's states on one device: the scalars of their next step, and
    the advance once the bucket has stepped.

    A count is a Python int while every step is known on the host (no flag ever given); the
    first flagged step makes it a 0-dim FP64 tensor on the parameter's device (as torch's fused
    Adam keeps its step on the device), advanced by (flag == 0). The scalars then come from it on
    the device in FP64 (`scalars.device_scalar_rows`): on CPU the same bits as the host's.
    Checkpoints hold the int or the tensor; both load and resume bit for bit."""

    def __init__(self, states: list[dict[str, Any]], device: torch.device, found_inf: torch.Tensor | None):
        self.states, self.device, self.found_inf = states, device, found_inf
        self.on_device = found_inf is not None or any(torch.is_tensor(state["step"]) for state in states)
        self.tensors = [self._device_step(state) for state in states] if self.on_device else []

    def _device_step(self, state: dict[str, Any]) -> torch.Tensor:
        """`state["step"]` as a 0-dim FP64 tensor on the device (made so once: from a host int, or
        a loaded tensor elsewhere or in another dtype)."""
        step = state["step"]
        if not torch.is_tensor(step):
            step = state["step"] = torch.full((), step, dtype=torch.float64, device=self.device)
        elif step.device != self.device or step.dtype != torch.float64:
            step = state["step"] = step.to(device=self.device, dtype=torch.float64)
        return step

    def scalars(self, **hyper: float) -> list[torch.Tensor]:
        """Each state's scalar row (FP32, on the device) for its next step."""
        if self.on_device:
            return device_scalar_rows(self.tensors, **hyper)
        by_step: dict[int, torch.Tensor] = {}
        for state in self.states:
            t = state["step"] + 1
            if t not in by_step:
                by_step[t] = scalar_rows(t, self.device, **hyper)
        return [by_step[state["step"] + 1] for state in self.states]

    def advance(self) -> None:
        """Count the step (not where the flag is set)."""
        if not self.on_device:
            for state in self.states:
                state["step"] += 1
        elif self.found_inf is None:
            torch._foreach_add_(self.tensors, 1.0)
        else:  # the list form: the tensor-scalar form reads the value on the host
            torch._foreach_add_(self.tensors, [(self.found_inf == 0).to(torch.float64)] * len(self.tensors))
