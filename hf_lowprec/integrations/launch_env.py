"""The environment `hf-lowprec launch` hands every process of its command, and its one reading.

The launcher (`integrations.launch`) writes these variables; in each process it starts, the
startup hook reads them through `launched_precision`, and so do the default factories of
`precision_strategy` and `precision_options` (`integrations.trainer`): a process launched with
a strategy takes it as the default of every TrainingArguments and TRL config it builds, and a
value on the script's command line wins. Standard library only: it is imported at every
launched process's start.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "APPLIED_PREFIX",
    "ENV_HOOKS",
    "ENV_LAUNCH",
    "ENV_OPTIONS",
    "ENV_STRATEGY",
    "HOOK_MARKER",
    "InheritedOptions",
    "is_launch_hook_dir",
    "json_object",
    "launched_default",
    "launched_precision",
    "note_hooked",
    "note_prepared_models",
    "note_strategy_applied",
]

ENV_LAUNCH = "HF_LOWPREC_LAUNCH"
# The same variables the repository's recipes read at their edge.
ENV_STRATEGY = "HF_LOWPREC_PRECISION_STRATEGY"
ENV_OPTIONS = "HF_LOWPREC_PRECISION_OPTIONS"
ENV_HOOKS = "HF_LOWPREC_LAUNCH_HOOKS"  # a directory where each hooked process leaves a file
APPLIED_PREFIX = "applied-"  # ... and each that prepared a model under a strategy, one more so named
# Written in launch_hook/sitecustomize.py, of this install and of any other (it cannot import this module).
HOOK_MARKER = b"hf_lowprec-launch-startup-hook"


def is_launch_hook_dir(entry: str) -> bool:
    """Whether the PYTHONPATH entry `entry` is the startup hook's directory of any hf_lowprec install."""
    try:
        with open(os.path.join(entry, "sitecustomize.py"), "rb") as f:
            return HOOK_MARKER in f.read()
    except OSError:
        return False


def json_object(text: str, what: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; ValueError naming `what` and the JSON error."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} must be a JSON object, got {text!r} ({err})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{what} must be a JSON object, got {text!r}")
    return parsed


def launched_precision(environ: Mapping[str, str] | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """(strategy, options) that `hf-lowprec launch` gave this process; (None, None) in any other.

    The launcher checked both before its command started (`launch.launch_environment`); a process
    reads them afresh, so each caller gets its own options dict."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_LAUNCH) != "1":
        return None, None
    strategy = environ.get(ENV_STRATEGY) or None
    options = json_object(environ[ENV_OPTIONS], f"${ENV_OPTIONS}") if environ.get(ENV_OPTIONS) else None
    return strategy, options


class InheritedOptions(dict):
    """Options a run inherited rather than was given (from `origin`): they belong to `strategy`, and
    `precision_arguments.check_precision_arguments` drops them, with a warning, under another."""

    def __init__(self, options: Mapping[str, Any], strategy: str | None, origin: str) -> None:
        super().__init__(options)
        self.strategy = strategy
        self.origin = origin


def launched_default(name: str) -> Any:
    """The default of a `precision_strategy` / `precision_options` argument left unset: what
    `hf-lowprec launch` gave this process, None elsewhere."""
    strategy, options = launched_precision()
    if name == "precision_strategy" or options is None:
        return strategy if name == "precision_strategy" else None
    return InheritedOptions(options, strategy, "hf-lowprec launch --precision_options")


def _leave_note(name: str, environ: Mapping[str, str]) -> None:
    if environ.get(ENV_HOOKS):
        try:
            with open(os.path.join(environ[ENV_HOOKS], name), "w"):
                pass
        except OSError:  # another node's filesystem: the launcher counts its own node's processes
            pass


def note_hooked(environ: Mapping[str, str]) -> None:
    """Tell the launcher that this process runs with the startup hook."""
    _leave_note(str(os.getpid()), environ)


def note_strategy_applied() -> None:
    """Tell the launcher that this process prepared a model under a precision strategy (a Trainer,
    a TRL trainer, `hf_lowprec.PrecisionPlugin`); outside `hf-lowprec launch`, nothing."""
    if os.environ.get(ENV_LAUNCH) == "1":
        _leave_note(f"{APPLIED_PREFIX}{os.getpid()}", os.environ)


def note_prepared_models(interface: Any) -> None:
    """Make every `PrecisionStrategy.prepare_model` of this process (the module `interface`, once
    imported) leave its note: a Trainer, TRL's trainers, the Accelerate plugin, and a custom loop
    that prepares its model itself (`strategy.prepare_model`, `engines.fsdp2.shard_model`) all call it."""
    cls = interface.PrecisionStrategy
    original = cls.prepare_model
    if getattr(original, "notes_the_launcher", False):
        return

    @functools.wraps(original)
    def prepare_model(self: Any, model: Any) -> Any:
        note_strategy_applied()
        return original(self, model)

    prepare_model.notes_the_launcher = True  # type: ignore[attr-defined]
    cls.prepare_model = prepare_model
