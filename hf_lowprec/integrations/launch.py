"""`hf-lowprec launch`: run any command so that every Python process it starts takes a strategy.

    hf-lowprec launch --precision_strategy collage-plus -- torchrun --nproc_per_node 2 run_clm.py ...

`run` puts a startup hook (`launch_hook/sitecustomize.py`) first on the command's `PYTHONPATH`; in
every process it starts, `install()` makes transformers' and TRL's trainers `hf_lowprec`'s as they
are imported (docs/launch.md). Both sides are here to share the patch points and error texts.
"""

from __future__ import annotations

import importlib
import importlib.abc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Imported at every launched process's start: the standard library (and launch_env) only at the top.
from .launch_env import (
    APPLIED_PREFIX,
    ENV_HOOKS,
    ENV_LAUNCH,
    ENV_OPTIONS,
    ENV_STRATEGY,
    is_launch_hook_dir,
    json_object,
    launched_precision,
    note_hooked,
    note_prepared_models,
)

__all__ = [
    "ENV_LAUNCH",
    "ENV_STRATEGY",
    "ENV_OPTIONS",
    "ENV_HOOKS",
    "HOOK_DIR",
    "NO_HOOK_EXIT",
    "UNUSED_STRATEGY_EXIT",
    "TESTED_VERSIONS",
    "launch_environment",
    "run",
    "install",
    "LaunchPatchError",
]

logger = logging.getLogger(__name__)

NO_HOOK_EXIT = 3  # the launcher's exit code when the command succeeded but no process was hooked
# ... and when it succeeded, hooked, but no process prepared a model under the launcher's strategy.
UNUSED_STRATEGY_EXIT = 4
_NOT_TRAINING = {"-h", "--help", "-V", "--version"}  # a command with one of these asks for its help or version
# Signals the launcher passes on to the command (Ctrl-C reaches it directly: same process group).
_FORWARDED = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")

# The directory put first on the launched command's PYTHONPATH (its sitecustomize.py calls install()).
HOOK_DIR = Path(__file__).with_name("launch_hook")

# The versions whose patch points were checked by the tests; others are tried, a missing patch point stops the process.
TESTED_VERSIONS = {"transformers": "5.24", "trl": "1.16"}

# `hf_lowprec.trl.TRAINER_KINDS` as the messages name them (not imported: this runs at every process start).
_TRL_KINDS = "SFT, Reward, GRPO, DPO, RLOO, KTO and Distillation"
_IMPORT_CHANGE = (
    "change the script's import instead: `from hf_lowprec import Trainer, TrainingArguments` "
    f"(TRL: `from hf_lowprec.trl import SFTConfig, SFTTrainer`, likewise for each of {_TRL_KINDS})"
)


class LaunchPatchError(RuntimeError):
    """A patch point of `hf-lowprec launch` is missing in the installed transformers or TRL."""


# --- the launcher's side ---------------------------------------------------------------------


def launch_environment(
    strategy: str | None, options: str | Mapping[str, Any] | None, environ: Mapping[str, str]
) -> dict[str, str]:
    """The environment of a launched command: the startup hook first on PYTHONPATH, the strategy's defaults.

    The strategy is built once here, so a misspelt name or a bad option stops before the
    command starts (the registry's error lists the valid names).
    """
    if isinstance(options, str) and options:
        options = json_object(options, f"--precision_options (or ${ENV_OPTIONS})")
    opts = dict(options or {})
    env = dict(environ)
    if strategy:
        from ..strategies.registry import get_strategy

        get_strategy(strategy, **opts)
        env[ENV_STRATEGY] = strategy
        if opts:
            env[ENV_OPTIONS] = json.dumps(opts)
        else:
            env.pop(ENV_OPTIONS, None)
    elif opts:
        raise ValueError("--precision_options were given without --precision_strategy; add --precision_strategy NAME")
    else:
        env.pop(ENV_STRATEGY, None)
        env.pop(ENV_OPTIONS, None)
    # Another install's hook directory too (a PYTHONPATH copied from a launched job, a nested launch).
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not is_launch_hook_dir(p)]
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK_DIR), *path])
    env[ENV_LAUNCH] = "1"
    return env


def run(command: Sequence[str], strategy: str | None, options: str | None) -> None:
    """Run `command` under the launch environment and exit with its exit code, or `NO_HOOK_EXIT`
    when it succeeded but none of its processes installed the startup hook (does not return)."""
    if not command:
        raise ValueError(
            "hf-lowprec launch needs a command after `--`, e.g. "
            "`hf-lowprec launch --precision_strategy collage-plus -- python train.py`"
        )
    env = launch_environment(strategy, options, os.environ)
    executable = _executable(command[0], env.get("PATH"))
    default = f"precision_strategy={strategy!r}" if strategy else "no default precision_strategy"
    print(
        f"hf-lowprec launch: {default} for every Python process of: {' '.join(command)} "
        "(a --precision_strategy on the script's command line wins)",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    with tempfile.TemporaryDirectory(prefix="hf_lowprec_launch_") as hooks:
        code = _run_child(executable, command, {**env, ENV_HOOKS: hooks})
        files = os.listdir(hooks)
    applied = sum(name.startswith(APPLIED_PREFIX) for name in files)
    hooked = len(files) - applied
    if hooked and strategy and not applied and code == 0 and not _NOT_TRAINING & set(command[1:]):
        print(
            f"hf-lowprec launch: `{' '.join(command)}` ran to its end, but none of its processes prepared a model "
            f"with a precision strategy, so nothing trained with precision_strategy={strategy!r}. The Trainer and "
            "TRL's trainers take it; a custom loop (plain Accelerate, plain torch) through hf_lowprec.PrecisionPlugin "
            "or hf_lowprec.get_strategy(name).prepare_model(model) (README); a script that set "
            "precision_strategy=None itself chose the stock Trainer.",
            file=sys.stderr,
            flush=True,
        )
        code = UNUSED_STRATEGY_EXIT
    if hooked == 0:
        took = f"trained with precision_strategy={strategy!r}" if strategy else "took the launcher's arguments"
        print(
            f"hf-lowprec launch: no Python process of `{' '.join(command)}` installed the startup hook, so none "
            f"{took}: the command replaced PYTHONPATH (keep {HOOK_DIR} first: PYTHONPATH=/x:$PYTHONPATH), started "
            "Python with -I, -E or -S, ran no Python, or the hook failed (said above). Fix the command, or "
            f"{_IMPORT_CHANGE}",
            file=sys.stderr,
            flush=True,
        )
        code = code or NO_HOOK_EXIT
    raise SystemExit(code)


def _executable(name: str, path: str | None) -> str:
    if os.sep not in name and not (os.altsep and os.altsep in name):
        executable = shutil.which(name, path=path)
        if executable is None:
            raise ValueError(f"hf-lowprec launch: command {name!r} was not found on PATH")
        return executable
    if not os.path.exists(name):
        raise ValueError(f"hf-lowprec launch: {name!r} does not exist")
    if os.path.isdir(name) or not os.access(name, os.X_OK):
        raise ValueError(f"hf-lowprec launch: {name!r} is not executable: chmod +x {name}, or run `python {name}`")
    return name


def _run_child(executable: str, command: Sequence[str], env: dict[str, str]) -> int:
    """Run the command and wait, passing termination signals on; its exit code (128 + N after signal N)."""
    received: list[int] = []  # a signal that comes before the child exists is passed on once it does
    children: list[subprocess.Popen] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        for child in children:
            child.send_signal(signum)

    forwarded = [getattr(signal, name) for name in _FORWARDED if hasattr(signal, name)]
    previous = {number: signal.signal(number, forward) for number in forwarded}
    try:  # the command's own handlers are reset by exec; an ignored SIGINT would not be
        children.append(subprocess.Popen(list(command), executable=executable, env=env))
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for signum in received:
            children[0].send_signal(signum)
        code = children[0].wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 128 - code if code < 0 else code


# --- the launched process's side ---------------------------------------------------------------


class _Patch:
    """The names swapped in transformers' modules, shown to everyone but TRL's own modules."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.swaps: list[tuple[Any, str, Any, Any]] = []  # (module, name, original, replacement)
        self.originals: tuple[type, type] | None = None  # transformers' TrainingArguments and Trainer
        self.trl_depth = 0  # TRL modules executing: they must subclass the original classes
        self.hf_lowprec_depth = 0  # hf_lowprec modules executing: the patch waits for them
        self.pending = False
        self.applied = False
        self.strategy: str | None = None
        self.options: dict[str, Any] | None = None

    def show(self, visible: bool) -> None:
        for module, name, original, replacement in self.swaps:
            setattr(module, name, replacement if visible else original)

    def enter(self, fullname: str) -> None:
        with self.lock:
            if _is_trl(fullname):
                self.trl_depth += 1
                if self.trl_depth == 1:
                    self.show(False)
            elif _is_hf_lowprec(fullname):
                self.hf_lowprec_depth += 1

    def leave(self, fullname: str, loaded: bool = True) -> None:
        with self.lock:
            if _is_trl(fullname):
                self.trl_depth -= 1
                if self.trl_depth == 0:
                    self.show(True)
            elif _is_hf_lowprec(fullname):
                self.hf_lowprec_depth -= 1
        if not loaded:  # the import failed: let its own error through
            return
        if fullname == "transformers" or (self.pending and self.hf_lowprec_depth == 0):
            self.patch_transformers()
        if fullname == "trl" and sys.modules.get("trl") is not None:
            _patch_trl(sys.modules["trl"])  # trl/__init__.py put its lazy module there
        if fullname == _INTERFACE:
            note_prepared_models(sys.modules[fullname])

    def patch_transformers(self) -> None:
        with self.lock:
            if self.applied:
                return
            if self.hf_lowprec_depth > 0:  # hf_lowprec's modules subclass the originals first
                self.pending = True
                return
            self.pending = False
            self.applied = True
            self.swaps = _transformers_swaps(self.strategy, self.options)
            self.originals = (self.swaps[0][2], self.swaps[3][2])
            self.show(self.trl_depth == 0)


_PATCH = _Patch()


_INTERFACE = "hf_lowprec.strategies.interface"  # its prepare_model tells the launcher a strategy was used


def _is_trl(fullname: str) -> bool:
    return fullname == "trl" or fullname.startswith("trl.")


def _is_hf_lowprec(fullname: str) -> bool:
    return fullname.startswith("hf_lowprec.") and fullname != __name__


class _WatchedLoader(importlib.abc.Loader):
    """Runs a module's loader between `_PATCH.enter` and `_PATCH.leave`."""

    def __init__(self, loader: Any, fullname: str) -> None:
        self.loader = loader
        self.fullname = fullname

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        _PATCH.enter(self.fullname)
        try:
            self.loader.exec_module(module)
        except BaseException:
            _PATCH.leave(self.fullname, loaded=False)
            raise
        _PATCH.leave(self.fullname)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, get_resource_reader, ...
        return getattr(self.loader, name)


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds transformers', TRL's and hf_lowprec's modules with the other finders, watching their loaders."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not (fullname == "transformers" or _is_trl(fullname) or _is_hf_lowprec(fullname)):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WatchedLoader(spec.loader, fullname)
                return spec
        return None


def install(environ: Mapping[str, str] | None = None) -> None:
    """Watch imports in this process (called by the startup hook when the launcher started it)."""
    environ = os.environ if environ is None else environ
    if any(isinstance(finder, _Watcher) for finder in sys.meta_path):
        return
    _PATCH.strategy, _PATCH.options = launched_precision(environ)
    sys.meta_path.insert(0, _Watcher())
    if "transformers" in sys.modules:
        _PATCH.patch_transformers()
    if "trl" in sys.modules:
        _patch_trl(sys.modules["trl"])
    if _INTERFACE in sys.modules:
        note_prepared_models(sys.modules[_INTERFACE])
    note_hooked(environ)


def _missing(what: str, package: str) -> LaunchPatchError:
    module = sys.modules.get(package)
    version = getattr(module, "__version__", "unknown")
    return LaunchPatchError(
        f"hf-lowprec launch cannot apply the precision strategy: {what} in {package} {version} "
        f"(the launcher was tested with transformers {TESTED_VERSIONS['transformers']} and TRL "
        f"{TESTED_VERSIONS['trl']}). Run without `hf-lowprec launch` and {_IMPORT_CHANGE}."
    )


def _transformers_swaps(strategy: str | None, options: dict[str, Any] | None) -> list[tuple[Any, str, Any, Any]]:
    """Check transformers' patch points, set the launcher's defaults, and list the names to swap."""
    try:
        # processing_utils executes transformers/__init__.py a second time, which puts a new
        # `transformers` module in sys.modules: import it first and patch the module it leaves.
        importlib.import_module("transformers.processing_utils")
        training_args = importlib.import_module("transformers.training_args")
        trainer_module = importlib.import_module("transformers.trainer")
    except ImportError as err:
        raise _missing(f"a module is missing ({err})", "transformers") from err
    transformers = sys.modules["transformers"]
    original_args = getattr(transformers, "TrainingArguments", None)
    original_trainer = getattr(transformers, "Trainer", None)
    points = {
        "transformers.training_args.TrainingArguments": getattr(training_args, "TrainingArguments", None)
        is original_args,
        "transformers.trainer.Trainer": getattr(trainer_module, "Trainer", None) is original_trainer,
        "transformers.trainer.TrainingArguments": getattr(trainer_module, "TrainingArguments", None) is original_args,
        "TrainingArguments as a dataclass": hasattr(original_args, "__dataclass_fields__"),
        "Trainer.__init__": isinstance(getattr(original_trainer, "__init__", None), type(install)),
    }
    for point, present in points.items():
        if not present:
            raise _missing(f"the patch point {point} is missing or changed", "transformers")

    from . import seq2seq
    from . import trainer as glue

    _refuse_trainers_without_strategy(original_trainer, glue.PrecisionTrainerMixin, strategy)
    version = getattr(transformers, "__version__", "")
    if not version.startswith(TESTED_VERSIONS["transformers"] + "."):
        logger.warning("hf-lowprec launch: transformers %s, tested with %s", version, TESTED_VERSIONS["transformers"])
    return [
        (transformers, "TrainingArguments", original_args, glue.TrainingArguments),
        (training_args, "TrainingArguments", original_args, glue.TrainingArguments),
        (trainer_module, "TrainingArguments", original_args, glue.TrainingArguments),
        (transformers, "Trainer", original_trainer, glue.Trainer),
        (trainer_module, "Trainer", original_trainer, glue.Trainer),
        *seq2seq.launch_swaps(),  # (transformers.Seq2SeqTrainer subclasses the stock Trainer)
    ]


def _refuse_trainers_without_strategy(original: type, mixin: type, strategy: str | None) -> None:
    """Make a Trainer that would ignore the launcher's strategy stop at construction."""
    if strategy is None:
        return
    init = original.__init__

    def __init__(self, model: Any = None, args: Any = None, *rest: Any, **kwargs: Any) -> None:
        if not isinstance(self, mixin) or (args is not None and not hasattr(args, "build_precision_strategy")):
            what = type(self) if not isinstance(self, mixin) else type(args)
            raise TypeError(
                f"hf-lowprec launch: {what.__module__}.{what.__qualname__} does not take precision_strategy="
                f"{strategy!r}, so it would train without it. Under the launcher, transformers.Trainer and "
                f"TrainingArguments (and their subclasses) and TRL's {_TRL_KINDS} configs and trainers (imported "
                f"from `trl`) take it. Drop --precision_strategy from the launcher, or {_IMPORT_CHANGE}."
            )
        init(self, model, args, *rest, **kwargs)

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    original.__init__ = __init__


class _PrecisionTRL:
    """Mixed into the `trl` module's class: its config and trainer names resolve to `hf_lowprec.trl`'s."""

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)  # type: ignore[misc]
        return _precision_name(self, name, value)


def _precision_name(module: Any, name: str, value: Any) -> Any:
    from . import trl_trainers as hl_trl  # what `hf_lowprec.trl` forwards to, imported where it is

    kinds = {f"{kind}{suffix}" for kind in hl_trl.TRAINER_KINDS for suffix in ("Config", "Trainer")}
    if name not in kinds:
        return value
    if not isinstance(value, type):
        raise _missing(f"trl.{name} is not a class", "trl")
    from .trainer import PrecisionArgumentsMixin, PrecisionTrainerMixin

    if _PATCH.originals is not None and not issubclass(value, _PATCH.originals):
        raise _missing(f"trl.{name} no longer subclasses transformers' TrainingArguments or Trainer", "trl")
    if issubclass(value, (PrecisionArgumentsMixin, PrecisionTrainerMixin)) and value.__module__ != hl_trl.__name__:
        # Built over hf_lowprec's classes: the mixin would sit under TRL's overrides (loss scaling lost).
        raise _missing(f"trl.{name} was defined over the patched transformers classes", "trl")
    wrapped = hl_trl.with_precision(value)
    setattr(module, name, wrapped)  # the lazy module cached the stock class under the name
    return wrapped


def _patch_trl(module: Any) -> None:
    """Make TRL's config and trainer names resolve to `hf_lowprec.trl`'s classes."""
    if isinstance(module, _PrecisionTRL):
        return
    base = type(module)
    if not hasattr(base, "__getattr__"):
        raise _missing("the lazy `trl` module (a module with __getattr__) is missing", "trl")
    module.__class__ = type("PrecisionTRLModule", (_PrecisionTRL, base), {})
    for name, value in list(vars(module).items()):
        if isinstance(value, type):
            _precision_name(module, name, value)
    version = getattr(module, "__version__", "")
    if not version.startswith(TESTED_VERSIONS["trl"] + "."):
        logger.warning("hf-lowprec launch: TRL %s, tested with %s", version, TESTED_VERSIONS["trl"])
