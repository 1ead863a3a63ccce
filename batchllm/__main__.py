"""`python -m batchllm`: the same as the `batchllm` command."""

import sys

from batchllm.entrypoints.cli.main import main

sys.exit(main())
