"""Child process for the memory test: load a MoE GGUF under a residency layer, generate greedily,
print JSON with the RSS growth (peak RSS minus RSS just before opening the model).

The peak is the kernel's VmHWM, reset after the warm-up through /proc/self/clear_refs ("5"), so
transient peaks of imports and the warm-up do not count; without that file, ru_maxrss is used
and the JSON says so (`peak_reset: false`).

Run as: python rss_child.py MODEL WARMUP_MODEL LAYER_JSON. Not a test module (no test_ prefix).
"""

import json
import re
import resource
import sys
from pathlib import Path
from types import SimpleNamespace

from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.moe.residency import load_model, plan_model
from localllm.engine.sampling.params import SamplingParams
from localllm.offload.expert_stats import expert_stats
from localllm.offload.residency import resolve

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def generate(path: str, layer: dict) -> tuple[list[int], object]:
    g = open_gguf(path)
    plan = plan_model(g, resolve([("test", layer)]), kv_tokens=64)
    model = load_model(g, plan)
    gen = Generator(g, model, SimpleNamespace(eog_ids=frozenset()), load_seconds=0.0)
    return list(gen.stream([1, 5, 9, 33, 7, 11], PARAMS)), model


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1))


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def main() -> None:
    path, warmup, layer = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    # torch's lazy one-time allocations (oneDNN/AMX kernels and scratch for these shapes: 10-17
    # MiB on some CPUs) happen before the baseline: the warm-up model has the measured one's
    # shapes and runs under the same layer, with too few experts to matter
    generate(warmup, layer)
    reset = reset_peak()
    before = _status_kib("VmRSS") * 1024
    out, model = generate(path, layer)
    if reset:
        peak = _status_kib("VmHWM") * 1024
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    held = [b.mlp.ffn_gate_exps.weight is not None for b in model.blk]  # disk tier: nothing held
    stats = expert_stats(model.expert_sources)
    print(
        json.dumps(
            {
                "tokens": out,
                "growth": peak - before,
                "peak_reset": reset,
                "budget": model.residency_plan.budget,
                "held": held,
                "misses": stats.misses,
                "bytes_read": stats.bytes_read,
            }
        )
    )


if __name__ == "__main__":
    main()
