"""`python -m hf_lowprec` and the `hf-lowprec` command (`main`): `cli.main`, imported with the
cyclic garbage collector off (importing torch and transformers makes about three million objects
and no garbage; the collector's passes over them took half a second), which are then frozen: they
live as long as the process, so later collections, and the one at exit, pass them by."""

import gc
import sys


def main(argv: list[str] | None = None) -> int:
    gc.disable()
    try:
        from .cli import main as run
    finally:
        gc.enable()
    gc.freeze()
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
