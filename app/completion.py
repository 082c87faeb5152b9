"""`localllm completion bash|zsh|fish`: a shell completion script made from the CLI's own parser.

`shtab` writes the script from the argparse parser, so every subcommand, flag and choice the
parser knows completes; flags that take a file or a folder complete paths. The script is static
(no Python runs at tab time); regenerate it after an upgrade.
"""

import argparse
import sys

SHELLS = ("bash", "zsh", "fish")
# Flags (by dest) whose value is a path: complete files or folders there.
FILE_DESTS = frozenset(
    {"model", "tui_model", "residency", "grammar_file", "history", "output", "file", "whisper",
     "tts", "voice"}
)  # fmt: skip
DIR_DESTS = frozenset({"models_dir"})

INSTALL = {
    "bash": "localllm completion bash > ~/.local/share/bash-completion/completions/localllm",
    "zsh": 'localllm completion zsh > "${fpath[1]}/_localllm"  (or a folder of your own on $fpath)',
    "fish": "localllm completion fish > ~/.config/fish/completions/localllm.fish",
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh or fish)",
        description="Print a completion script for SHELL on stdout.",
        epilog="install it with: " + "; ".join(f"{s}: {cmd}" for s, cmd in INSTALL.items()),
    )
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(handler=handle)


def _mark_paths(parser: argparse.ArgumentParser, shtab) -> None:
    """Tell shtab which flags take paths, in the parser and every subcommand's parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases share a parser
                _mark_paths(child, shtab)
        elif action.choices is not None:
            continue  # shtab completes the choices themselves
        elif action.dest in FILE_DESTS:
            action.complete = shtab.FILE
        elif action.dest in DIR_DESTS:
            action.complete = shtab.DIRECTORY


def script(shell: str) -> str:
    """The completion script for `shell`."""
    import shtab

    from localllm.app.cli import build_parser

    if shell not in SHELLS:
        raise ValueError(f"no completion for {shell!r}; one of {', '.join(SHELLS)}")
    parser = build_parser()
    _mark_paths(parser, shtab)
    return shtab.complete(parser, shell=shell)


def handle(args: argparse.Namespace) -> int:
    sys.stdout.write(script(args.shell))
    return 0
