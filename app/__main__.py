"""`python -m localllm.app` runs the CLI."""

import sys

from .cli import main

sys.exit(main())
