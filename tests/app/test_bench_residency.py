"""`localllm bench` with residency flags on a tiny MoE: the plan is printed on --show-plan, the
model is loaded under it, and each result carries the expert cache's counters of its timed runs
(json, csv and the markdown footer)."""

import csv
import io
import json

import pytest

from localllm.app.cli import main
from tests.offload.tiny_moe import QWEN3MOE, write_moe_gguf

SPEC = QWEN3MOE  # 2 layers x 8 experts, top-2
SLOT_BYTES = 3 * SPEC.dim * SPEC.expert_ff * 4  # F32 experts: gate + up + down


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("bench_moe") / "moe.gguf", SPEC)


def _bench(capsys, moe, *flags: str, output: str = "json"):
    argv = ["bench", "-m", str(moe), "-p", "8", "-n", "3", "-r", "2", "-o", output, *flags]
    assert main(argv) == 0
    return capsys.readouterr().out


def test_one_slot_misses_every_lookup(moe, capsys):
    """One slot and no read-ahead: each lookup evicts the previous expert, so every lookup is a
    miss reading one whole expert; a tg step looks up k experts in each layer."""
    flags = ("--experts", "disk", "--expert-slots", "1", "--expert-prefetch", "off")
    rows = json.loads(_bench(capsys, moe, *flags))
    pp, tg = rows
    for r in rows:
        e = r["experts"]
        assert e["lookups"] > 0 and e["hits"] == 0 and e["misses"] == e["lookups"]
        assert e["bytes_read"] == e["misses"] * SLOT_BYTES
        assert e["read_gbps"] > 0 and e["stall_s"] > 0
    assert tg["experts"]["lookups"] == 2 * 3 * SPEC.n_layers * SPEC.n_used  # reps x steps x L x k
    assert pp["experts"]["lookups"] <= 2 * SPEC.n_layers * SPEC.n_expert


def test_resident_experts_only_hit_and_no_plan_no_counters(moe, capsys):
    rows = json.loads(_bench(capsys, moe, "--experts", "device"))
    for r in rows:
        e = r["experts"]
        assert e["hits"] == e["lookups"] > 0 and e["misses"] == 0 and e["bytes_read"] == 0
    rows = json.loads(_bench(capsys, moe))
    assert [r["experts"] for r in rows] == [None, None]


def test_csv_and_markdown_show_the_counters(moe, capsys):
    flags = ("--experts", "disk", "--expert-slots", "1", "--expert-prefetch", "off")
    rows = list(csv.DictReader(io.StringIO(_bench(capsys, moe, *flags, output="csv"))))
    assert len(rows) == 2
    for r in rows:
        assert int(r["expert_misses"]) == int(r["expert_lookups"]) > 0
        assert int(r["expert_bytes_read"]) == int(r["expert_misses"]) * SLOT_BYTES
        assert float(r["expert_read_gbps"]) > 0 and float(r["expert_stall_s"]) > 0
    text = _bench(capsys, moe, *flags, output="md")
    footer = [line for line in text.splitlines() if line.startswith("expert cache")]
    assert [line.split(":")[0] for line in footer] == ["expert cache pp8", "expert cache tg3"]
    assert "0 hits" in footer[1] and "hit rate 0.00" in footer[1] and "GB/s" in footer[1]


def test_show_plan_prints_and_loads_nothing(moe, capsys):
    out = _bench(capsys, moe, "--experts", "disk", "--expert-slots", "3", "--show-plan")
    assert "residency plan on cpu" in out and "expert slots 3 x" in out
    assert "| model |" not in out  # nothing was run


def test_a_split_runs_footer_tells_the_cpus_pairs_from_the_devices_hits():
    """Split counts the CPU's pairs as hits (served where they are): the footer says how many
    and gives the device's own rate, its slots' hits over the pairs it looked up."""
    from localllm.app.bench import ExpertCounters

    c = ExpertCounters(800, 500, 300, 0, 0.0, 0.0, 0, 0.0, 0.0, cpu_pairs=200)
    line = c.line()
    assert "hit rate 0.62; 200 of the hits by the CPU's share, the device's 0.50" in line
    plain = ExpertCounters(800, 500, 300, 0, 0.0, 0.0, 0, 0.0, 0.0)
    assert "CPU" not in plain.line() and "(hit rate 0.62)" in plain.line()
