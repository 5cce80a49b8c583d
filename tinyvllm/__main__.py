"""`python -m tinyvllm ...` is the `tinyvllm` command."""

import sys

from tinyvllm.entrypoints.cli import main

sys.exit(main())
