"""The `localllm` command line: parse arguments, dispatch to a subcommand, map errors to exit codes.

Usage errors (an unknown flag, a bad value, a missing argument) print one `localllm: error:` line
naming the flag and exit 2. Errors while running (bad files, values the engine refuses, missing
models) print one `localllm: error:` line and exit 1; `--verbose` adds the traceback. Only
generated text goes to stdout. Building the parser imports no torch: `--help` stays instant, and
each subcommand imports its heavy modules in its handler.
"""

import argparse
import importlib
import logging
import re
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
    "localllm.app.music",
    "localllm.app.doctor",
    "localllm.app.completion",
)
# One-shot commands whose process ends with their handler: no interpreter teardown (see _exit_now)
EXIT_AT_ONCE = frozenset({"run"})

# The engine's names for what the flags set (`SamplingParams`, `EngineArgs`), by the flag's dest:
# its checks say "max_tokens must be >= 1", the user typed -n.
ENGINE_NAMES = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "typical_p": "typical",
    "repetition_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_model_len": "ctx_size",
    "max_num_seqs": "parallel",
}
_ENGINE_LIMIT = re.compile(r"^(?P<name>[a-z_]+) (?P<rest>must .*)$", re.DOTALL)
# a compiler's source excerpt inside a message: `    ^`, `   1 | start: /(/`
_EXCERPT = re.compile(r"^\s*(\^+|~+|\d*\s*\|.*)\s*$")


class CliParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `localllm: error: <flag>: <what>`, with a pointer to
    the command's `--help` (exit 2); the subcommands' parsers are of this class too."""

    def error(self, message: str):
        message = re.sub(r"^argument COMMAND: invalid choice: ", "unknown command ", message)
        message = re.sub(r"^argument (\S+): ", r"\1: ", message)
        self.exit(2, f"localllm: error: {one_line(message)} (see `{self.prog} --help`)\n")


def one_line(message: str) -> str:
    """A multi-line message (a grammar compiler's, an install hint) as one line: its lines
    joined, source excerpts and caret markers left out."""
    lines = [ln.strip() for ln in message.splitlines() if not _EXCERPT.match(ln)]
    return " ".join(ln for ln in lines if ln)


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="localllm", description="Local LLM inference.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    importlib.import_module("localllm.app.tui_cmd").add_tui_flags(parser)  # `localllm` = the TUI
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The subcommand's parser (the top-level one when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def flag_message(message: str, parser: argparse.ArgumentParser) -> str:
    """The engine's `max_tokens must be >= 1` as the user's `-n/--max-tokens must be >= 1`."""
    m = _ENGINE_LIMIT.match(message)
    dest = ENGINE_NAMES.get(m["name"]) if m else None
    for action in parser._actions if dest else ():
        if action.dest == dest and action.option_strings:
            return f"{'/'.join(action.option_strings)} {m['rest']}"
    return message


def distribution_version() -> str:
    """The installed distribution's version (the wheel's metadata, not a constant in code)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("localllm")
    except PackageNotFoundError:  # run from a bare checkout, never installed
        return "unknown (not installed)"


def entry() -> int:
    """The `localllm` command (and `python -m localllm.app`): `process.apply_settings`, then
    `main`. (Tests call `main` in their own process and leave that process as it is.)"""
    from localllm.app.process import apply_settings

    apply_settings()
    return main()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = command_parser(parser, args.command)
    if extra:  # reported by the command's own parser, which points at its --help
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.version:
        print(f"localllm {distribution_version()}")
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
        code = args.handler(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0  # the reader went away (e.g. `| head`); nothing left to say
    except Exception as e:
        if verbose:
            traceback.print_exc()
        kind = "error" if isinstance(e, ValueError | OSError | LookupError) else "internal error"
        msg = one_line(flag_message(str(e), command)) or type(e).__name__
        print(f"localllm: {kind}: {msg}", file=sys.stderr)
        return 1
    if argv is None and args.command in EXIT_AT_ONCE:  # the process's own command line
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process without the interpreter's teardown of modules and objects, which took
    0.7 s after `run`'s last token (2-core box, tests/perf/results/cpu.md); exit handlers still
    run and stdout and stderr are flushed."""
    import atexit
    import contextlib
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BrokenPipeError, ValueError):  # a reader gone, a stream closed
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
