"""The process-global settings a test or the package can change, read by public APIs: the suite's
guard (tests/conftest.py) reads them before and after each test and fails the test that changed one.
An autocast left on by one call once failed 215 later tests of the same process, far from its cause."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import transformers

# transformers sets its logger's level on its first use, once a process: done here, before any
# test reads the level, and not inside whichever test happens to log first.
transformers.logging.get_verbosity()

__all__ = ["LOGGERS", "changes", "restore", "snapshot"]

# The loggers whose levels the package sets (hf_lowprec.planning.models.quiet, hf_lowprec.demo).
LOGGERS = ("hf_lowprec", "transformers")


# Written by other libraries for their own use, not leaks of a test: pytest (the running test's
# name and phase), Inductor (an address, before it loads each compiled kernel), DeepSpeed's import
# (`setdefault`, once per process).
_LIBRARIES_OWN = frozenset(
    {"PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "PYTORCH_NVML_BASED_CUDA_CHECK"}
)


def _devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def snapshot() -> dict[str, Any]:
    """Each setting's name and value now; environment variables under `environ:<name>`."""
    state: dict[str, Any] = {}
    for device in _devices():
        state[f"torch.is_autocast_enabled({device!r})"] = torch.is_autocast_enabled(device)
        state[f"torch.get_autocast_dtype({device!r})"] = torch.get_autocast_dtype(device)
    state.update(
        {
            "torch.is_autocast_cache_enabled()": torch.is_autocast_cache_enabled(),
            "torch.get_default_dtype()": torch.get_default_dtype(),
            "torch.is_grad_enabled()": torch.is_grad_enabled(),
            "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
            "torch.is_anomaly_enabled()": torch.is_anomaly_enabled(),
            "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
            "torch.is_deterministic_algorithms_warn_only_enabled()": (
                torch.is_deterministic_algorithms_warn_only_enabled()
            ),
            "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
            "torch.get_num_threads()": torch.get_num_threads(),
            "torch.backends.cudnn.deterministic": torch.backends.cudnn.deterministic,
            "torch.backends.cudnn.benchmark": torch.backends.cudnn.benchmark,
            "torch.backends.cudnn.enabled": torch.backends.cudnn.enabled,
            "torch.backends.mkldnn.enabled": torch.backends.mkldnn.enabled,
            "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction": (
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
            ),
            "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction": (
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
            ),
        }
    )
    for name in LOGGERS:
        state[f"logging.getLogger({name!r}).level"] = logging.getLogger(name).level
    state.update({f"environ:{k}": v for k, v in os.environ.items() if k not in _LIBRARIES_OWN})
    return state


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per setting that differs: its name, its value before and after (`unset` for an
    environment variable that was not there)."""
    lines = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key, "unset"), after.get(key, "unset")
        if old != new:
            name = f"os.environ[{key.removeprefix('environ:')!r}]" if key.startswith("environ:") else key
            lines.append(f"{name}: {old!r} before the test, {new!r} after")
    return lines


def restore(before: dict[str, Any]) -> None:
    """Put back the environment and the settings that have a public setter as `before` has them, so
    that one test's leak fails that test alone (inference and anomaly modes have none: left as they are)."""
    for key in [k for k in os.environ if f"environ:{k}" not in before and k not in _LIBRARIES_OWN]:
        del os.environ[key]
    os.environ.update({k.removeprefix("environ:"): v for k, v in before.items() if k.startswith("environ:")})
    for device in _devices():
        torch.set_autocast_enabled(device, before[f"torch.is_autocast_enabled({device!r})"])
        torch.set_autocast_dtype(device, before[f"torch.get_autocast_dtype({device!r})"])
    torch.set_autocast_cache_enabled(before["torch.is_autocast_cache_enabled()"])
    torch.set_default_dtype(before["torch.get_default_dtype()"])
    torch.set_grad_enabled(before["torch.is_grad_enabled()"])
    torch.use_deterministic_algorithms(
        before["torch.are_deterministic_algorithms_enabled()"],
        warn_only=before["torch.is_deterministic_algorithms_warn_only_enabled()"],
    )
    torch.set_float32_matmul_precision(before["torch.get_float32_matmul_precision()"])
    torch.set_num_threads(before["torch.get_num_threads()"])
    for flag in ("deterministic", "benchmark", "enabled"):
        setattr(torch.backends.cudnn, flag, before[f"torch.backends.cudnn.{flag}"])
    torch.backends.mkldnn.enabled = before["torch.backends.mkldnn.enabled"]
    for precision in ("bf16", "fp16"):
        flag = f"allow_{precision}_reduced_precision_reduction"
        setattr(torch.backends.cuda.matmul, flag, before[f"torch.backends.cuda.matmul.{flag}"])
    for name in LOGGERS:
        logging.getLogger(name).setLevel(before[f"logging.getLogger({name!r}).level"])
