"""The `localllm` command line: parse arguments, dispatch to a subcommand, map errors to exit codes.

User errors (bad files, bad flags, missing models) print one `localllm: error:` line and exit 1;
`--verbose` adds the traceback. Only generated text goes to stdout.
"""

import argparse
import importlib
import logging
import sys
import traceback

# Subcommand modules, each with add_parser(sub) that sets `handler`.
COMMANDS = (
    "localllm.app.run",
    "localllm.app.serve",
    "localllm.app.models_cmd",
    "localllm.app.bench",
    "localllm.app.tui_cmd",
    "localllm.app.transcribe",
    "localllm.app.tts",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localllm", description="Local LLM inference.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    importlib.import_module("localllm.app.tui_cmd").add_tui_flags(parser)  # `localllm` = the TUI
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from importlib.metadata import version

        print(f"localllm {version('localllm')}")
        return 0
    if args.command is None:
        return importlib.import_module("localllm.app.tui_cmd").handle_default(args, parser)
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="localllm: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0  # the reader went away (e.g. `| head`); nothing left to say
    except Exception as e:
        if verbose:
            traceback.print_exc()
        kind = "error" if isinstance(e, ValueError | OSError | LookupError) else "internal error"
        msg = str(e) or type(e).__name__
        print(f"localllm: {kind}: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
