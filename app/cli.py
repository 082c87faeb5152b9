"""The `localllm` command line: subcommands and argument parsing (placeholder until run lands)."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("localllm: not ready yet", file=sys.stderr)
    return 1
