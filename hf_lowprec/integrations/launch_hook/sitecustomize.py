"""Startup hook of `hf-lowprec launch`: this directory is first on the launched command's PYTHONPATH.

Inert unless HF_LOWPREC_LAUNCH is set; then it installs hf_lowprec's import watcher
(`hf_lowprec.integrations.launch.install`). The sitecustomize this file shadows, if any, runs next.
Python reports an exception raised here as "Error in sitecustomize" and runs the script anyway,
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


def _install():
    try:
        from hf_lowprec.integrations.launch import install
    except ImportError as err:
        sys.meta_path.insert(0, _RefuseTransformers(err))
        return
    try:
        install()
    except Exception as err:
        sys.stderr.write(
            f"hf-lowprec launch: the startup hook failed in {sys.executable} (pid {os.getpid()}): "
            f"{type(err).__name__}: {err}\nThis process stops here: it would train without the precision strategy.\n"
        )
        sys.stderr.flush()
        os._exit(HOOK_FAILED_EXIT)


def _run_shadowed_sitecustomize():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get("HF_LOWPREC_LAUNCH") == "1":
    _install()
_run_shadowed_sitecustomize()
