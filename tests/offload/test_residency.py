"""Residency settings and the planner: rule order, precedence of sources, shortcuts, sizes,
unknown keys, a budget too small, patterns that match nothing, auto-fit placement."""

import json

import pytest

from localllm.offload.memory import MemoryInfo
from localllm.offload.plan import plan_residency
from localllm.offload.residency import (
    ResidencyError,
    load_document,
    parse_rules,
    parse_size,
    parse_tier,
    resolve,
)

MiB = 1 << 20
# a 4-layer MoE: 1 MiB of non-expert weights per layer, 8 experts of 3 x 256 KiB per layer
SIZES = {"token_embd.weight": 2 * MiB, "output_norm.weight": 1024}
for _i in range(4):
    SIZES[f"blk.{_i}.attn_q.weight"] = MiB
    for _w in ("gate", "up", "down"):
        SIZES[f"blk.{_i}.ffn_{_w}_exps.weight"] = 2 * MiB
CPU = MemoryInfo("cpu", host_free=64 * MiB)
N_EXPERT = 8
SLOT = 3 * 2 * MiB // N_EXPERT  # one expert's gate+up+down


def plan(layers, kv=MiB, memory=CPU, min_slots=2):
    return plan_residency(resolve(layers), SIZES, kv, memory, N_EXPERT, min_slots)


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("6GiB", 6 << 30),
        ("512MiB", 512 << 20),
        ("1.5G", int(1.5 * (1 << 30))),
        ("8GB", 8 * 10**9),
        ("100", 100),
        (4096, 4096),
        (" 2 kib ", 2048),
    ],
)
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["6 giga", "", "-1GiB", "0", True, 1.5, "GiB"])
def test_bad_sizes_are_errors(bad):
    with pytest.raises(ResidencyError):
        parse_size(bad)


def test_tiers_accept_llama_cpp_buffer_names():
    assert [parse_tier(t) for t in ("CPU", "CUDA0", "Metal", "disk", "Host")] == [
        "host",
        "device",
        "device",
        "disk",
        "host",
    ]
    with pytest.raises(ResidencyError, match="unknown tier 'ram'"):
        parse_tier("ram")


def test_override_spelling_like_llama_cpp_ot():
    rules = parse_rules(r"blk\.0\.=CUDA0,exps=CPU", "cli")
    assert [(r.pattern, r.tier) for r in rules] == [(r"blk\.0\.", "device"), ("exps", "host")]
    with pytest.raises(ResidencyError, match="not PATTERN=TIER"):
        parse_rules("exps", "cli")
    with pytest.raises(ResidencyError, match="bad pattern"):
        parse_rules("blk[=disk", "cli")


def test_first_matching_rule_wins_and_cli_beats_document():
    p = plan(
        [
            ("cli", {"rules": [r"blk\.1\.ffn_.*_exps=host"]}),
            ("doc", {"rules": [r"ffn_.*_exps=disk", r"blk\.1\.=device"]}),
        ]
    )
    et = p.expert_tiers()
    assert et == {0: "disk", 1: "host", 2: "disk", 3: "disk"}
    assert p.tiers["blk.1.attn_q.weight"] == "device"


def test_layer_rules_come_before_its_shortcuts():
    cfg = resolve([("cli", {"experts": "disk", "rules": [r"blk\.3\.ffn_.*_exps=device"]})])
    assert [r.tier for r in cfg.rules] == ["device", "disk"]
    assert (
        plan(
            [("cli", {"experts": "disk", "rules": [r"blk\.3\.ffn_.*_exps=device"]})]
        ).expert_tiers()[3]
        == "device"
    )


def test_precedence_cli_over_env_over_document(tmp_path):
    doc = tmp_path / "r.toml"
    doc.write_text(
        'budget = "1GiB"\nload_mode = "read"\n[streaming]\nslots = 3\nprefetch = false\n'
    )
    layers = [
        ("cli", {"budget": "2GiB"}),
        ("env", {"budget": "3GiB", "load_mode": "mmap"}),
        (str(doc), load_document(doc)),
    ]
    cfg = resolve(layers)
    assert cfg.budget == 2 << 30 and cfg.load_mode == "mmap"
    assert cfg.streaming.slots == 3 and cfg.streaming.prefetch is False
    assert cfg.streaming.enabled is True  # the default, nobody set it
    assert resolve([]).budget is None and resolve([]).load_mode == "mmap"


def test_split_share_from_any_layer_reaches_the_plan(tmp_path):
    doc = tmp_path / "r.toml"
    doc.write_text('host_compute = "split"\nsplit_share = 0.5\n')
    cfg = resolve([("env", {"split_share": "0.75"}), (str(doc), load_document(doc))])
    assert cfg.split_share == 0.75 and cfg.host_compute == "split"  # env over the document
    assert resolve([(str(doc), load_document(doc))]).split_share == 0.5
    assert resolve([]).split_share is None  # engine.moe.split's defaults
    p = plan([("cli", {"cpu_moe": True, "split_share": 0.375})])
    assert p.split_share == 0.375 and plan([("cli", {"cpu_moe": True})]).split_share is None


def test_shortcuts_cpu_moe_and_n_cpu_moe():
    assert set(plan([("cli", {"cpu_moe": True})]).expert_tiers().values()) == {"host"}
    et = plan([("cli", {"n_cpu_moe": 2})]).expert_tiers()
    assert (et[0], et[1]) == ("host", "host")
    assert (et[2], et[3]) == ("device", "device")  # auto-fit: 64 MiB is plenty


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"budgett": "1GiB"}, "unknown key 'budgett'"),
        ({"streaming": {"slot": 2}}, r"\[streaming\]: unknown key 'slot'"),
        ({"rules": [{"pattern": "x", "tier": "host", "why": 1}]}, "unknown key 'why'"),
        ({"rules": [{"pattern": "x"}]}, "needs both pattern and tier"),
        ({"load_mode": "direct"}, "load_mode must be one of"),
        ({"n_cpu_moe": -1}, "n_cpu_moe must be >= 0"),
        ({"cpu_moe": "yes"}, "cpu_moe must be true or false"),
        ({"streaming": {"slots": 0}}, "slots must be >= 1"),
        ({"experts": "gpu0"}, "unknown tier"),
        ({"split_share": 1}, "split_share must be between 0 and 1, got 1"),
        ({"split_share": 0}, "split_share must be between 0 and 1"),
        ({"split_share": "half"}, "split_share must be between 0 and 1, got 'half'"),
        ({"split_share": True}, "split_share must be between 0 and 1"),
    ],
)
def test_invalid_documents_are_errors(tmp_path, doc, match):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ResidencyError, match=match):
        load_document(path)


def test_malformed_document_files(tmp_path):
    bad = tmp_path / "r.toml"
    bad.write_text("budget = \n")
    with pytest.raises(ResidencyError, match="not a valid residency document"):
        load_document(bad)
    with pytest.raises(ResidencyError, match="cannot read"):
        load_document(tmp_path / "missing.toml")
    lst = tmp_path / "r.json"
    lst.write_text("[1, 2]")
    with pytest.raises(ResidencyError, match="expected a table"):
        load_document(lst)


def test_budget_too_small_for_non_expert_weights():
    # non-expert: 2 MiB embedding + 4 x 1 MiB attention + 1 KiB norm = 6 MiB, KV 1 MiB
    with pytest.raises(ResidencyError, match=r"too small: the non-expert weights need 6\.00 MiB"):
        plan([("cli", {"budget": "6MiB", "experts": "disk"})])
    plan([("cli", {"budget": "9MiB", "experts": "disk"})])  # 7 MiB + two slots fit


def test_pattern_matching_nothing_warns_with_close_names():
    p = plan([("cli", {"rules": [r"blk\.0\.ffn_gate_exp\.weight=host"]})])
    (w,) = p.warnings
    assert "matches no tensor" in w and "blk.0.ffn_gate_exps.weight" in w
    assert "warning: pattern" in p.describe()


def test_disk_only_for_experts():
    with pytest.raises(ResidencyError, match="only routed-expert tensors"):
        plan([("cli", {"rules": ["token_embd=disk"]})])


def test_auto_fit_streams_what_does_not_fit():
    # 7 MiB fixed; 24 MiB of experts (6 MiB per layer); 20 MiB budget leaves 13 MiB:
    # two layers on the device (12 MiB) would leave no room for 2 slots of 768 KiB -> one layer
    p = plan([("cli", {"budget": "20MiB"})])
    assert p.expert_tiers() == {0: "device", 1: "disk", 2: "disk", 3: "disk"}
    used = 6 * MiB + 1024 + 6 * MiB + MiB  # non-expert + layer 0's experts + KV
    assert p.streaming.slots == (20 * MiB - used) // SLOT
    assert p.slot_bytes == SLOT
    assert p.bytes_by_tier() == {"device": 12 * MiB + 1024, "host": 0, "disk": 18 * MiB}
    text = p.describe()
    assert "experts of layers 1-3 auto-placed on disk" in text
    assert "did not fit" in text and "expert slots" in text


def test_auto_fit_uses_host_before_disk_with_a_separate_device():
    gpu = MemoryInfo("cuda:0", host_free=14 * MiB, device_free=20 * MiB)
    p = plan([], memory=gpu)
    assert p.expert_tiers() == {0: "device", 1: "host", 2: "host", 3: "disk"}
    assert "measured free memory" in p.describe()


def test_streaming_disabled_fails_fast_when_experts_do_not_fit():
    with pytest.raises(ResidencyError, match="streaming is disabled"):
        plan([("cli", {"budget": "20MiB", "streaming": {"enabled": False}})])


def test_too_many_slots_is_an_error():
    with pytest.raises(ResidencyError, match="slots"):
        plan([("cli", {"budget": "9MiB", "experts": "disk", "streaming": {"slots": 8}})])
