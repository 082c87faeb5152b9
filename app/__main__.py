"""`python -m localllm.app` runs the CLI."""

import sys

from localllm.app.cli import main

sys.exit(main())
