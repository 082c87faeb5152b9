"""The residency flags on `localllm run` / `serve`: precedence flags > environment > document,
`--show-plan` (prints, loads nothing), fail-fast errors, and a disk-streamed run whose greedy
output equals the default run's."""

import pytest

from localllm.app.cli import build_parser, main
from localllm.app.residency_flags import residency_config
from localllm.offload.residency import ResidencyConfig, ResidencyError
from tests.offload.tiny_moe import write_moe_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("cli") / "moe.gguf")


def parse(*flags: str):
    return build_parser().parse_args(["run", "-m", "x.gguf", *flags, "hi"])


def test_no_flags_means_no_plan():
    assert residency_config(parse(), env={}) == ResidencyConfig()


def test_flags_beat_environment_beat_document(tmp_path):
    doc = tmp_path / "plan.toml"
    doc.write_text(
        'budget = "1GiB"\nload_mode = "read"\nrules = ["output=host"]\n[streaming]\nslots = 9\n'
    )
    env = {
        "LOCALLLM_RESIDENCY": str(doc),
        "LOCALLLM_MEM_BUDGET": "2GiB",
        "LOCALLLM_EXPERT_SLOTS": "5",
        "LOCALLLM_OT": r"blk\.0\.=device",
        "LOCALLLM_CPU_MOE": "1",
    }
    cfg = residency_config(parse("--mem-budget", "3GiB", "--ot", r"exps=disk"), env=env)
    assert cfg.budget == 3 << 30  # flag
    assert cfg.streaming.slots == 5  # environment over the document's 9
    assert cfg.load_mode == "read"  # only the document says it
    assert [(r.pattern, r.tier, r.source) for r in cfg.rules] == [
        ("exps", "disk", "command line"),
        (r"blk\.0\.", "device", "environment"),
        (r"\.ffn_(up|down|gate)_exps", "host", "environment cpu_moe"),
        ("output", "host", str(doc)),
    ]
    # --residency on the command line replaces $LOCALLLM_RESIDENCY
    other = tmp_path / "other.json"
    other.write_text('{"load_mode": "mmap"}')
    assert residency_config(parse("--residency", str(other)), env=env).load_mode == "mmap"


def test_bad_environment_values():
    with pytest.raises(ResidencyError, match="LOCALLLM_EXPERT_SLOTS must be an integer"):
        residency_config(parse(), env={"LOCALLLM_EXPERT_SLOTS": "many"})
    with pytest.raises(ResidencyError, match="LOCALLLM_CPU_MOE must be 1 or 0"):
        residency_config(parse(), env={"LOCALLLM_CPU_MOE": "maybe"})


def test_show_plan_prints_and_exits(model, capsys, monkeypatch):
    monkeypatch.delenv("LOCALLLM_RESIDENCY", raising=False)
    rc = main(["run", "-m", str(model), "--show-plan", "--experts", "disk", "--expert-slots", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "model moe.gguf (qwen3moe)" in out
    assert "disk      384.00 KiB  6 tensors" in out  # 2 layers x 3 tensors of 8 x 32 x 64 f32
    assert "expert slots 3 x 24.00 KiB" in out
    assert r"\.ffn_(up|down|gate)_exps -> disk  (command line experts)" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mem-budget", "100KiB"], "too small: the non-expert weights need"),
        (["--mem-budget", "lots"], "cannot read size 'lots'"),
        (["--ot", "token_embd=disk"], "only routed-expert tensors"),
        (["--residency", "/nonexistent/plan.toml"], "cannot read residency document"),
    ],
)
def test_errors_before_loading(model, flags, message, capsys):
    assert main(["run", "-m", str(model), "--show-plan", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("localllm: error:") and message in err


def test_unknown_document_key_is_an_error(model, tmp_path, capsys):
    doc = tmp_path / "plan.toml"
    doc.write_text("[streaming]\nslot = 2\n")
    assert main(["run", "-m", str(model), "--residency", str(doc), "hi"]) == 1
    assert "unknown key 'slot'" in capsys.readouterr().err


def test_streamed_run_prints_what_the_default_run_prints(model, capsys):
    common = ["run", "-m", str(model), "--temp", "0", "-n", "16", "--no-chat", "--ignore-eos"]
    assert main([*common, "hello"]) == 0
    want = capsys.readouterr().out
    assert main([*common, "--experts", "disk", "--expert-slots", "2", "-v", "hello"]) == 0
    got = capsys.readouterr()
    assert got.out == want and len(want) >= 8
    assert "misses" in got.err and " 0 misses" not in got.err  # it did stream


def test_serve_show_plan_prints_and_exits(model, capsys):
    """`serve --show-plan` prints the plan of each model and starts no server."""
    rc = main(["serve", "-m", str(model), "--show-plan", "--cpu-moe", "--load-mode", "read"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "host      384.00 KiB  6 tensors" in out and "load mode read" in out


def test_flags_typed_as_one_line_read_as_the_command_lines(tmp_path):
    """The TUI load dialog's line: the same flags, over the environment and a document in the
    same order; a bad flag or value and an unbalanced quote raise ResidencyError (no exit)."""
    from localllm.app.residency_flags import residency_from_text

    doc = tmp_path / "r.toml"
    doc.write_text('budget = "2GiB"\nhost_compute = "host"\n')
    env = {"LOCALLLM_RESIDENCY": str(doc), "LOCALLLM_EXPERT_SLOTS": "9"}
    env["LOCALLLM_SPLIT_SHARE"] = "0.25"
    line = "--cpu-moe --ot 'blk\\.0\\..*_exps=disk' --host-compute split --split-share 0.5"
    got = residency_from_text(line, env)
    flags = ("--cpu-moe", "--ot", r"blk\.0\..*_exps=disk", "--host-compute", "split")
    want = residency_config(parse(*flags, "--split-share", "0.5"), env)
    assert got == want and got.split_share == 0.5  # the flag over the environment
    assert got.host_compute == "split" and got.budget == 2 << 30 and got.streaming.slots == 9
    assert residency_from_text("", env).split_share == 0.25
    assert got.rules[0].pattern == r"blk\.0\..*_exps" and got.rules[0].tier == "disk"
    assert residency_from_text("", {}) == ResidencyConfig()
    for bad, msg in (
        ("--expert-slots many", "many"),
        ("--tier gpu", "unrecognized arguments"),
        ("--host-compute gpu", "invalid choice"),
        ("--split-share 1.5", "split_share must be between 0 and 1, got 1.5"),
        ("--ot 'unclosed", "cannot read the flags"),
    ):
        with pytest.raises(ResidencyError, match=msg):
            residency_from_text(bad, {})
