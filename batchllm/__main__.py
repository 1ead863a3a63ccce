"""`python -m batchllm`: the same as the `batchllm` command."""

import sys

from batchllm.cli import main

sys.exit(main())
