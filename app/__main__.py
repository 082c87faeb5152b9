"""`python -m localllm.app` runs the CLI."""

import sys

from localllm.app.cli import entry

sys.exit(entry())
