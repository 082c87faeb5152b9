"""`localllm` with no subcommand (or `localllm tui`): start the Textual TUI.

`-m MODEL` opens with that model loaded (a path, a library name or `org/repo:QUANT`, which is
downloaded with a progress bar); `--endpoint URL` chats with an OpenAI-compatible server instead
of the local engine. Without a terminal, plain `localllm` prints the help as before.
"""

import argparse
import sys
from pathlib import Path

from localllm.app.engine_flags import add_engine_flags, engine_kwargs


def add_tui_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m", "--model", dest="tui_model", metavar="MODEL", help="model to load (default: embedded)"
    )
    p.add_argument(
        "--endpoint", metavar="URL", help="use an OpenAI-compatible server (http://host:port/v1)"
    )
    p.add_argument(
        "--api-key", dest="tui_api_key", metavar="KEY", help="bearer token for --endpoint"
    )
    p.add_argument(
        "--history", type=Path, metavar="FILE", help="history database (default: XDG data dir)"
    )
    p.add_argument(
        "--mmproj", dest="tui_mmproj", metavar="FILE",
        help="vision projector for the -m model (a Hub model brings its own)",
    )  # fmt: skip


def add_parser(sub) -> None:
    p = sub.add_parser("tui", help="the chat TUI (also what `localllm` alone starts)")
    add_tui_flags(p)
    add_engine_flags(p)
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from localllm.app.tui.app import LocalLLMApp
    from localllm.app.tui.config import load_config
    from localllm.app.tui.history import HistoryStore, history_path
    from localllm.app.tui.loaders import endpoint_loader, engine_loader

    config = load_config()  # invalid settings fail here, with a clear message
    endpoint = getattr(args, "endpoint", None)
    if endpoint:
        loader = endpoint_loader(endpoint, getattr(args, "tui_api_key", None))
    else:
        kw = engine_kwargs(args) if hasattr(args, "cache_type") else {}
        kw = {k: v for k, v in kw.items() if v is not None}
        mmproj = getattr(args, "tui_mmproj", None)
        if mmproj and not getattr(args, "tui_model", None):
            raise ValueError("--mmproj pairs with the -m model: name it")
        pair = (args.tui_model, mmproj) if mmproj else None
        loader = engine_loader(pair, max_num_seqs=1, **kw)
    store = HistoryStore(getattr(args, "history", None) or history_path())
    try:
        app = LocalLLMApp(store, loader, model=getattr(args, "tui_model", None), config=config)
        app.run()
    finally:
        store.close()
    return app.return_code or 0


def handle_default(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """No subcommand: the TUI on a terminal, the help (exit 2) otherwise."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        parser.print_help(sys.stderr)
        return 2
    return handle(args)
