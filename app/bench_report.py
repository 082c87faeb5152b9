"""What `localllm bench` reports: a test's result (`BenchResult`), the expert cache's counters
over its timed runs (`ExpertCounters`), and llama-bench's markdown and CSV rows for them."""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localllm.engine.moe.split_link import SplitBalance

# llama-bench's names for the file types (general.file_type: llama.h's LLAMA_FTYPE_MOSTLY_*)
FTYPE_NAMES = {0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
               10: "Q2_K - Medium", 11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large",
               14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium",
               18: "Q6_K", 19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw",
               21: "Q2_K - Small", 22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw",
               24: "IQ1_S - 1.5625 bpw", 25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw",
               27: "IQ3_S mix - 3.66 bpw", 28: "IQ2_S - 2.5 bpw", 29: "IQ2_M - 2.7 bpw",
               30: "IQ4_XS - 4.25 bpw", 31: "IQ1_M - 1.75 bpw", 32: "BF16",
               36: "TQ1_0 - 1.69 bpw ternary", 37: "TQ2_0 - 2.06 bpw ternary", 38: "MXFP4 MoE",
               39: "NVFP4"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class BenchResult:
    model_filename: str
    model_type: str
    model_size: int  # bytes of tensor data
    model_n_params: int
    backend: str
    n_prompt: int
    n_gen: int
    n_depth: int
    avg_ts: float
    stddev_ts: float
    samples_ts: list[float]
    experts: "ExpertCounters | None" = None  # with a residency plan: the timed runs' counters
    split: "SplitBalance | None" = None  # split host experts: how the two sides waited (timed)
    routing: str = "model"  # `--routing`: the router's experts, or drawn ones

    @property
    def test(self) -> str:
        name = f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"
        name += f" @ d{self.n_depth}" if self.n_depth else ""
        return name + (f" ({self.routing})" if self.routing != "model" else "")


@dataclass(frozen=True, slots=True)
class ExpertCounters:
    """Expert-cache counters summed over a test's timed runs (warm-up excluded)."""

    lookups: int
    hits: int
    misses: int
    bytes_read: int
    read_gbps: float
    stall_s: float
    prefetch_hits: int
    guess_rate: float
    prepare_s: float  # of the stall: preparing (CPU) or packing (device) the experts read
    cpu_pairs: int = 0  # of the hits: pairs split's CPU share computed (not the device's slots)

    @classmethod
    def between(cls, before, after) -> "ExpertCounters":
        """From two `ExpertStats` snapshots."""
        read_s = after.read_seconds - before.read_seconds
        nbytes = after.bytes_read - before.bytes_read
        guessed = after.guessed - before.guessed
        right = after.guessed_right - before.guessed_right
        return cls(
            after.lookups - before.lookups,
            after.hits - before.hits,
            after.misses - before.misses,
            nbytes,
            nbytes / read_s / 1e9 if read_s > 0 else 0.0,
            after.stall_seconds - before.stall_seconds,
            after.prefetch_hits - before.prefetch_hits,
            right / guessed if guessed else 0.0,
            after.prepare_seconds - before.prepare_seconds,
            after.cpu_pairs - before.cpu_pairs,
        )

    def line(self) -> str:
        rate = self.hits / self.lookups if self.lookups else 0.0
        split = ""
        if self.cpu_pairs:  # the device's own rate: its slots' hits over the pairs it looked up
            own = self.lookups - self.cpu_pairs
            dev = (self.hits - self.cpu_pairs) / own if own else 0.0
            split = f"; {self.cpu_pairs} of the hits by the CPU's share, the device's {dev:.2f}"
        return (
            f"{self.hits} hits, {self.misses} misses (hit rate {rate:.2f}{split}), "
            f"{self.bytes_read / 1e9:.3f} GB read at {self.read_gbps:.2f} GB/s, "
            f"stall {self.stall_s:.3f} s (packing or preparing {self.prepare_s:.3f} s)"
        )


def model_info(gguf, backend: str) -> tuple[str, int, int, str]:
    arch = gguf.architecture or "?"
    n_params = sum(math.prod(info.shape) for info in gguf.tensors.values())
    ftype = gguf.metadata.get("general.file_type")
    kind = FTYPE_NAMES.get(ftype, f"ftype {ftype}") if ftype is not None else "?"
    name = f"{arch} {n_params / 1e9:.1f}B {kind}"
    return name, gguf.nbytes, n_params, backend


_FIELDS = (
    "model_filename",
    "model_type",
    "model_size",
    "model_n_params",
    "backend",
    "n_prompt",
    "n_gen",
    "n_depth",
    "avg_ts",
    "stddev_ts",
)
_EXPERT_FIELDS = ("lookups", "hits", "misses", "bytes_read", "read_gbps", "stall_s")


def csv_header(results: list[BenchResult]) -> str:
    extra = [f"expert_{f}" for f in _EXPERT_FIELDS] if any_experts(results) else []
    return ",".join((*_FIELDS, *extra))


def csv_row(r: BenchResult, with_experts: bool) -> str:
    cells = [_csv(getattr(r, f)) for f in _FIELDS]
    if with_experts:
        e = r.experts
        cells += [_csv(getattr(e, f)) if e is not None else "" for f in _EXPERT_FIELDS]
    return ",".join(cells)


def any_experts(results: list[BenchResult]) -> bool:
    return any(r.experts is not None for r in results)


def _csv(v) -> str:
    s = f"{v:.6f}" if isinstance(v, float) else str(v)
    return f'"{s}"' if "," in s or " " in s else s


def md_header() -> str:
    return (
        "| model | size | params | backend | test | t/s |\n"
        "| ------------------------------ | ---------: | ---------: | ------- | ------------: "
        "| -------------------: |"
    )


def md_row(r: BenchResult) -> str:
    size = f"{r.model_size / 2**30:.2f} GiB"
    params = f"{r.model_n_params / 1e9:.2f} B"
    ts = f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}"
    cells = (f"{r.model_type:<30}", f"{size:>10}", f"{params:>10}", f"{r.backend:<7}")
    return "| " + " | ".join((*cells, f"{r.test:>13}", f"{ts:>20}")) + " |"
