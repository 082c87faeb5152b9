"""Run a module with engine switches set, for A/B device runs (not a test):

    python tests/perf/with_switches.py localllm.kernels.quant.triton_linear.BATCH_GEMM=True \
        -- -m localllm.app serve -m model.gguf ...
    python tests/perf/with_switches.py MODULE.NAME=VALUE ... -- tests/perf/bench_engine.py ...

Each MODULE.NAME=VALUE imports MODULE and sets its NAME to VALUE (a Python literal), before the
program after `--` runs (a `-m` module or a script path) with the remaining arguments: the
switches that ship off until a GPU has timed them (`triton_linear.BATCH_GEMM`, ...) flip for one
process without touching the tree.
"""

import ast
import importlib
import runpy
import sys


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit(__doc__)
    cut = argv.index("--")
    for item in argv[:cut]:
        target, _, literal = item.partition("=")
        module, _, name = target.rpartition(".")
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            sys.exit(f"with_switches: {module} has no {name}")
        setattr(mod, name, ast.literal_eval(literal))
        print(f"with_switches: {target} = {getattr(mod, name)!r}", file=sys.stderr)
    rest = argv[cut + 1 :]
    if rest[:1] == ["-m"]:
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
