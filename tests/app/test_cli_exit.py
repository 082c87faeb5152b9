"""`localllm run` as its own process ends without the interpreter's teardown (`cli._exit_now`):
what it printed, its exit handlers and its exit status stay as before, and `main()` called with
an argument list (tests, embedding) still returns instead of ending the caller's process."""

import subprocess
import sys

from localllm.app.cli import main

RUN = ["run", "Hi", "-n", "3", "--temp", "0", "--ignore-eos", "--no-chat", "-t", "1"]
# the console script's own call: main() reads sys.argv; an exit handler registered beforehand
SCRIPT = """
import atexit, sys
atexit.register(lambda: print("exit handler ran", file=sys.stderr, flush=True))
from localllm.app.cli import main
sys.argv = ["localllm", *sys.argv[1:]]
sys.exit(main())
"""


def test_run_process_output_handlers_and_status(capsys):
    assert main(RUN) == 0  # returns: the argument list is not the process's own command line
    in_process = capsys.readouterr().out
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *RUN], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == in_process and proc.stdout.endswith("\n") and len(proc.stdout) > 1
    assert "exit handler ran" in proc.stderr


def test_run_process_error_status():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "run", "-m", "/nonexistent.gguf", "hi"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.startswith("localllm: error: model not found")
    assert "exit handler ran" in proc.stderr
