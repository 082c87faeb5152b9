"""Layering, packaging and size rules of DESIGN §2, checked by parsing every module."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "offload", "engine", "media", "app")
# Imports point downward only: app -> media -> engine -> offload -> kernels.
ALLOWED = {
    "kernels": set(),
    "offload": {"kernels"},
    "engine": {"kernels", "offload"},
    "media": {"kernels", "offload", "engine"},
    "app": {"kernels", "offload", "engine", "media"},
}
# Third-party imports each layer may use (stdlib is always allowed).
THIRD_PARTY = {
    "kernels": {"torch", "triton", "numpy"},
    "offload": {"torch", "numpy", "psutil"},
    "engine": {"torch", "numpy", "gguf", "tokenizers", "jinja2", "llguidance"},
    "media": {
        "torch",
        "numpy",
        "soundfile",
        "soxr",
        "tokenizers",
        "onnx",
        "espeakng_loader",
        "PIL",
        "av",  # video decoding (the optional `video` extra)
        "num2words",  # SmolVLM2's video prompt (the `video` extra)
    },
    "app": {
        "torch",
        "numpy",
        "fastapi",
        "starlette",
        "uvicorn",
        "textual",
        "huggingface_hub",
        "pydantic",
        "httpx",
        "psutil",
        "shtab",  # `localllm completion`
        "sounddevice",  # optional: the TUI plays spoken answers when it is installed
    },
}
LINE_CAP = 500


def _modules(pkg):
    return sorted((ROOT / pkg).rglob("*.py"))


def _imports(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_import_arrows_point_down():
    import sys

    stdlib = set(sys.stdlib_module_names)
    bad = []
    for pkg in PACKAGES:
        for path in _modules(pkg):
            for name in _imports(path):
                top = name.split(".")[0]
                if top == "localllm":
                    target = name.split(".")[1] if "." in name else ""
                    if target != pkg and target not in ALLOWED[pkg]:
                        bad.append(f"{path.relative_to(ROOT)} imports {name}")
                elif top in PACKAGES:
                    bad.append(f"{path.relative_to(ROOT)} imports bare {name}")
                elif top not in stdlib and top not in THIRD_PARTY[pkg]:
                    bad.append(f"{path.relative_to(ROOT)} imports third-party {name}")
    assert not bad, "\n".join(bad)


def test_every_package_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(cfg["tool"]["setuptools"]["packages"])
    mapping = cfg["tool"]["setuptools"]["package-dir"]
    assert mapping == {f"localllm.{p}": p for p in PACKAGES}
    found = set()
    for pkg in PACKAGES:
        for init in (ROOT / pkg).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).parts
            found.add(".".join(("localllm", *rel)))
    assert found == listed, f"missing: {found - listed}, stale: {listed - found}"


def test_no_namespace_init_and_no_root_conftest():
    assert not (ROOT / "localllm" / "__init__.py").exists()
    assert not (ROOT / "conftest.py").exists()


def test_file_size_cap():
    big = []
    for pkg in (*PACKAGES, "tests"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name.endswith("_table.py"):
                continue  # generated data tables are exempt
            n = len(path.read_text().splitlines())
            if n > LINE_CAP:
                big.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not big, "\n".join(big)


def test_every_module_has_a_docstring():
    missing = []
    for pkg in PACKAGES:
        for path in _modules(pkg):
            tree = ast.parse(path.read_text())
            if not ast.get_docstring(tree):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, missing


def test_only_app_reads_the_environment():
    bad = []
    for pkg in ("kernels", "offload", "engine", "media"):
        for path in _modules(pkg):
            text = path.read_text()
            if "os.environ" in text or "os.getenv" in text:
                bad.append(str(path.relative_to(ROOT)))
    assert not bad, bad


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(("localllm", *parts))


def test_no_import_cycles():
    """No two modules import each other, directly or around a loop: at module level, inside
    functions or for type checking alike (each is a dependency; a lazy import only hides one).
    `from pkg import mod` counts as importing `pkg.mod`, not the package."""
    paths = {_module_name(p): p for pkg in PACKAGES for p in _modules(pkg)}
    graph = {}
    for name, path in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in paths else node.module)
        graph[name] = {d for d in deps if d in paths and d != name}
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node, trail):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*trail[trail.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*trail, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)
