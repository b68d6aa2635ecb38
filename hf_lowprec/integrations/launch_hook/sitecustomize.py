"""Startup hook of `hf-lowprec launch`: this directory is first on the launched command's PYTHONPATH.

Inert unless HF_LOWPREC_LAUNCH is set; then it installs hf_lowprec's import watcher
(`hf_lowprec.integrations.launch.install`). The first sitecustomize after it on the path that is not
another hf_lowprec install's copy of this hook runs next. Python reports an exception raised here as "Error in sitecustomize" and runs the script anyway,
without the strategy: so a failing install ends the process here, with the reason and exit code 2.
"""

import os
import sys


class _RefuseTransformers:
    """Stops `import transformers` in an interpreter that cannot import hf_lowprec."""

    def __init__(self, reason):
        self.reason = reason

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "transformers":
            raise ImportError(
                f"hf-lowprec launch: {sys.executable} cannot import hf_lowprec ({self.reason}), so this process "
                "would train without the precision strategy; run the command with the Python where hf-lowprec "
                "is installed"
            )
        return None


HOOK_FAILED_EXIT = 2
# In every copy of this file, and in no other sitecustomize: the copies skip each other when chaining.
HOOK_MARKER = b"hf_lowprec-launch-startup-hook"


def _stop(err):
    sys.stderr.write(
        f"hf-lowprec launch: the startup hook failed in {sys.executable} (pid {os.getpid()}): "
        f"{type(err).__name__}: {err}\nThis process stops here: it would train without the precision strategy.\n"
    )
    sys.stderr.flush()
    os._exit(HOOK_FAILED_EXIT)


def _install():
    try:  # `import hf_lowprec` itself checks the environment (HF_LOWPREC_CPU_GEMM): a ValueError is a failure
        from hf_lowprec.integrations.launch import install
    except ImportError as err:
        sys.meta_path.insert(0, _RefuseTransformers(err))
        return
    except Exception as err:
        _stop(err)
    try:
        install()
    except Exception as err:
        _stop(err)


def _is_launch_hook(origin):
    if origin is None:  # a namespace package
        return False
    try:
        with open(origin, "rb") as f:
            return HOOK_MARKER in f.read()
    except OSError:
        return False


def _run_shadowed_sitecustomize():
    import importlib.machinery
    import importlib.util

    # Each entry alone, so that another install's hook directory (a second hf_lowprec on the path) is
    # skipped rather than run: it would look for the shadowed file in turn and find this one again.
    for entry in list(sys.path):
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None and not _is_launch_hook(spec.origin):
            break
    else:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get("HF_LOWPREC_LAUNCH") == "1":
    _install()
_run_shadowed_sitecustomize()
