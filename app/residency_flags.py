"""Residency flags and environment for the commands that load a model (`run`, `serve`, `bench`,
the TUI and its load dialog): the one place that turns `--residency FILE`, `--ot`, `--cpu-moe`,
... and `LOCALLLM_*` variables into an `offload.residency.ResidencyConfig` (precedence: flags >
environment > document > default).

Environment: LOCALLLM_RESIDENCY (document path), LOCALLLM_OT (PATTERN=TIER[,...]),
LOCALLLM_CPU_MOE (1/0), LOCALLLM_N_CPU_MOE, LOCALLLM_EXPERTS, LOCALLLM_EXPERT_SLOTS,
LOCALLLM_MEM_BUDGET, LOCALLLM_LOAD_MODE, LOCALLLM_HOST_COMPUTE, LOCALLLM_EXPERT_EVICT,
LOCALLLM_EXPERT_PREFETCH (1/0), LOCALLLM_EXPERT_READS, LOCALLLM_SPLIT_SHARE.
"""

import argparse
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from localllm.offload.residency import (
    EVICTIONS,
    HOST_COMPUTE,
    LOAD_MODES,
    READS,
    TIERS,
    ResidencyConfig,
    ResidencyError,
    load_document,
    resolve,
)

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def add_residency_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("residency (where weights live; MoE expert offload)")
    g.add_argument("--residency", metavar="FILE", help="residency document (TOML or JSON)")
    g.add_argument(
        "--ot",
        "--override-tensor",
        dest="ot",
        action="append",
        default=[],
        metavar="PATTERN=TIER",
        help="tensors whose GGUF name matches the regex go to device/host/disk (repeatable; "
        "first match wins; llama.cpp's CPU/CUDA0 accepted)",
    )
    g.add_argument(
        "--cpu-moe", action="store_true", default=None, help="all routed experts on host"
    )
    g.add_argument(
        "--n-cpu-moe", type=int, metavar="N", help="experts of the first N layers on host"
    )
    g.add_argument("--experts", choices=TIERS, help="tier for every routed expert")
    g.add_argument(
        "--host-compute",
        choices=HOST_COMPUTE,
        help="host-tier experts on a GPU box: auto (default: mapped where the GPU's kernels "
        "take them, else host), mapped (the GPU reads them in host memory), host (the CPU "
        "computes them), split (mapped, and the CPU computes a share of each token's experts "
        "at the same time), device (copied over per use)",
    )
    g.add_argument(
        "--split-share",
        type=float,
        metavar="F",
        help="host_compute split: the share of each decode token's experts the CPU computes "
        "(default 0.625, 5 of 8; 0.25 over device slots); `bench` prints how the two sides "
        "waited for each other",
    )
    g.add_argument(
        "--expert-slots",
        type=int,
        metavar="N",
        help="device slots for streamed (disk) or mapped host experts (default: what the "
        "budget leaves for disk experts; for host experts none, or the device's room when "
        "auto-fit puts every layer's experts on host)",
    )
    g.add_argument("--expert-evict", choices=EVICTIONS, help="slot eviction: lru (default) or lfu")
    g.add_argument(
        "--expert-prefetch",
        choices=("on", "off"),
        help="read ahead the experts the next layer's router guesses (default: off; it "
        "measured slower, CPU-only and on a GPU)",
    )
    g.add_argument(
        "--expert-reads",
        choices=READS,
        help="who asks for a streamed expert's read on a GPU: gpu (the decode step stays one "
        "CUDA graph and waits on the device for a reader thread), host (a host step per "
        "layer), auto (default: gpu where its reader builds)",
    )
    g.add_argument("--mem-budget", metavar="SIZE", help="memory the plan may use, e.g. 6GiB")
    g.add_argument("--load-mode", choices=LOAD_MODES, help="mmap (default) or read into RAM")
    g.add_argument("--show-plan", action="store_true", help="print the residency plan and exit")


def _streaming(
    slots: int | None, evict: str | None, prefetch: bool | None, reads: str | None = None
) -> dict[str, Any]:
    given = {"slots": slots, "evict": evict, "prefetch": prefetch, "reads": reads}
    st = {k: v for k, v in given.items() if v is not None}
    return {"streaming": st} if st else {}


def _bool_env(env: Mapping[str, str], name: str) -> bool | None:
    if name not in env:
        return None
    v = env[name].strip().lower()
    if v not in _TRUE + _FALSE:
        raise ResidencyError(f"${name} must be 1 or 0, got {v!r}")
    return v in _TRUE


def cli_layer(args: argparse.Namespace) -> dict[str, Any]:
    layer: dict[str, Any] = {"rules": list(args.ot)} if args.ot else {}
    for key, value in (
        ("cpu_moe", args.cpu_moe),
        ("n_cpu_moe", args.n_cpu_moe),
        ("experts", args.experts),
        ("host_compute", args.host_compute),
        ("split_share", args.split_share),
        ("budget", args.mem_budget),
        ("load_mode", args.load_mode),
    ):
        if value is not None:
            layer[key] = value
    prefetch = None if args.expert_prefetch is None else args.expert_prefetch == "on"
    st = _streaming(args.expert_slots, args.expert_evict, prefetch, args.expert_reads)
    return layer | st


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    if name not in env:
        return None
    try:
        return int(env[name])
    except ValueError:
        raise ResidencyError(f"${name} must be an integer, got {env[name]!r}") from None


def env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    layer: dict[str, Any] = {}
    if env.get("LOCALLLM_OT"):
        layer["rules"] = [env["LOCALLLM_OT"]]
    if (cpu_moe := _bool_env(env, "LOCALLLM_CPU_MOE")) is not None:
        layer["cpu_moe"] = cpu_moe
    if (n := _env_int(env, "LOCALLLM_N_CPU_MOE")) is not None:
        layer["n_cpu_moe"] = n
    for key, name in (
        ("experts", "LOCALLLM_EXPERTS"),
        ("host_compute", "LOCALLLM_HOST_COMPUTE"),
        ("split_share", "LOCALLLM_SPLIT_SHARE"),
        ("budget", "LOCALLLM_MEM_BUDGET"),
        ("load_mode", "LOCALLLM_LOAD_MODE"),
    ):
        if env.get(name):
            layer[key] = env[name]
    slots = _env_int(env, "LOCALLLM_EXPERT_SLOTS")
    prefetch = _bool_env(env, "LOCALLLM_EXPERT_PREFETCH")
    evict, reads = env.get("LOCALLLM_EXPERT_EVICT") or None, env.get("LOCALLLM_EXPERT_READS")
    return layer | _streaming(slots, evict, prefetch, reads or None)


def residency_config(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> ResidencyConfig:
    """Flags, then environment, then the document (`--residency` or $LOCALLLM_RESIDENCY)."""
    env = os.environ if env is None else env
    layers = [("command line", cli_layer(args)), ("environment", env_layer(env))]
    doc = args.residency or env.get("LOCALLLM_RESIDENCY")
    if doc:
        layers.append((str(doc), load_document(Path(doc))))
    return resolve(layers)


class _LineParser(argparse.ArgumentParser):
    """argparse for flags typed in a dialog: a bad flag raises instead of exiting."""

    def error(self, message: str):
        raise ResidencyError(message)


def residency_from_text(text: str, env: Mapping[str, str] | None = None) -> ResidencyConfig:
    """Residency flags typed as one line, in the command line's spelling (`--cpu-moe
    --expert-slots 64`), over the environment and document as `residency_config` orders them;
    ResidencyError for an unknown flag or a bad value (the TUI's load dialog)."""
    try:
        words = shlex.split(text)
    except ValueError as e:  # an unbalanced quote
        raise ResidencyError(f"cannot read the flags: {e}") from None
    parser = _LineParser(prog="load", add_help=False)
    add_residency_flags(parser)
    return residency_config(parser.parse_args(words), env)


def plan_text(
    model: Path, config: ResidencyConfig, device: str = "cpu", ctx: int | None = None,
    precise: bool = False, seqs: int = 1, quantize: str | None = None,
) -> str:  # fmt: skip
    """The plan loading `model` under `config` would follow, as text (reads the header only);
    `seqs`: the sequences a step runs (a hybrid model holds a recurrent state for each);
    `quantize`: a Hugging Face folder's --quantize (its tensors' sizes as they will be held)."""
    from localllm.engine.loader import open_weights
    from localllm.engine.moe.residency import plan_model
    from localllm.offload.memory import probe_memory

    with open_weights(model, quantize) as g:
        plan = plan_model(g, config, ctx, probe_memory(device), precise, seqs)
        return f"model {model.name} ({g.architecture})\n{plan.describe()}"


def show_plan(model: Path, args: argparse.Namespace, config: ResidencyConfig) -> str:
    """The plan `run`/`serve` would load `model` with, as text (reads the header only)."""
    device = getattr(args, "device", "cpu")
    seqs = getattr(args, "parallel", 1)  # (serve's --parallel; run takes one sequence)
    quantize = getattr(args, "quantize", None)
    return plan_text(model, config, device, args.ctx_size, args.precise, seqs, quantize)
