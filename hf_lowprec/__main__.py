"""`python -m hf_lowprec` is the `hf-lowprec` command line."""

import sys

from .cli import main

sys.exit(main())
