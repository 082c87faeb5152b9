"""Everything a person touches: the `localllm` CLI (and later the server, TUI and hub downloads).

Only this package reads environment variables and user config files.
"""
