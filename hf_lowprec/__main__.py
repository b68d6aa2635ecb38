"""`python -m hf_lowprec` and the `hf-lowprec` command (`main`): `cli.main`, imported with the
cyclic garbage collector off (importing torch and transformers makes about three million objects
and no garbage; the collector's passes over them took half a second), which are then frozen: they
live as long as the process, so later collections, and the one at exit, pass them by."""

import gc
import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    gc.disable()
    try:
        from .cli import main as run
    finally:
        gc.enable()
    gc.freeze()
    try:
        status = run(argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
    except BrokenPipeError:
        # The reader went away (`hf-lowprec plan | head`): stop quietly with the status of a
        # command that SIGPIPE ended, as standard tools do; nothing more reaches the pipe at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
