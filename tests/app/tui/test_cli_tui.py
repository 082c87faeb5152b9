"""`localllm` alone starts the TUI only on a terminal; without one it prints the help as before."""

import pytest

from localllm.app import cli, tui_cmd


def test_no_subcommand_without_a_terminal_prints_help(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "usage: localllm" in err and "--endpoint URL" in err and "tui" in err


def test_no_subcommand_on_a_terminal_starts_the_tui(monkeypatch):
    seen = {}
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setattr(tui_cmd, "handle", lambda args: seen.setdefault("args", args) and 0)
    assert cli.main(["-m", "some.gguf", "--endpoint", "http://h:1/v1"]) == 0
    assert (seen["args"].tui_model, seen["args"].endpoint) == ("some.gguf", "http://h:1/v1")


def test_tui_subcommand_takes_engine_flags():
    args = cli.build_parser().parse_args(["tui", "-m", "x.gguf", "-c", "2048", "--history", "h.db"])
    assert (args.tui_model, args.ctx_size, str(args.history)) == ("x.gguf", 2048, "h.db")
    assert args.handler is tui_cmd.handle
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["tui", "--bogus"])
