"""Model spec parsing and quant resolution over file lists (no network)."""

import pytest

from localllm.app.hub.quant import HubError, RepoFile, group_ggufs, quant_of, resolve_files
from localllm.app.hub.spec import parse_spec


@pytest.mark.parametrize(
    ("text", "repo", "quant", "filename", "revision"),
    [
        ("org/repo", "org/repo", None, None, None),
        ("bartowski/Qwen2.5-0.5B-GGUF:q4_k_m", "bartowski/Qwen2.5-0.5B-GGUF", "q4_k_m", None, None),
        ("https://huggingface.co/org/repo", "org/repo", None, None, None),
        ("hf.co/org/repo", "org/repo", None, None, None),
        (
            "https://huggingface.co/org/repo/blob/main/m-Q8_0.gguf",
            "org/repo",
            None,
            "m-Q8_0.gguf",
            "main",
        ),
        (
            "https://huggingface.co/org/repo/resolve/v1/sub/m.gguf?download=true",
            "org/repo",
            None,
            "sub/m.gguf",
            "v1",
        ),
        ("https://huggingface.co/org/repo/tree/dev", "org/repo", None, None, "dev"),
    ],
)
def test_hub_specs(text, repo, quant, filename, revision):
    s = parse_spec(text)
    assert (s.kind, s.repo, s.quant, s.filename, s.revision) == (
        "hub",
        repo,
        quant,
        filename,
        revision,
    )


def test_paths_and_names(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert parse_spec(str(f)).kind == "path"
    assert parse_spec("models/not-yet.gguf").kind == "path"  # a .gguf name is a path even if absent
    assert parse_spec(str(tmp_path)).kind == "path"  # an existing folder
    assert parse_spec("smollm2-135m").kind == "name"
    assert parse_spec("org/repo:Q4_K_M").pull_command() == "localllm pull org/repo:Q4_K_M"


@pytest.mark.parametrize(
    "bad", ["", "https://huggingface.co/org", "https://huggingface.co/org/repo/blob/main/README.md"]
)
def test_bad_specs(bad):
    with pytest.raises(ValueError):
        parse_spec(bad)


@pytest.mark.parametrize(
    ("stem", "tag"),
    [
        ("Qwen3-8B-Q4_K_M", "Q4_K_M"),
        ("model.iq4_xs", "IQ4_XS"),
        ("gemma-3-270m-it-BF16", "BF16"),
        ("Llama-3.2-1B-Instruct-f16", "F16"),
        ("Qwen3-30B-A3B-UD-Q4_K_XL", "UD-Q4_K_XL"),
        ("gpt-oss-20b-MXFP4", "MXFP4"),
        ("plain-model", None),
    ],
)
def test_quant_of(stem, tag):
    assert quant_of(stem) == tag


def _files(*names):
    return [RepoFile(n, 10) for n in names]


def test_split_groups_need_every_shard():
    groups, mm = group_ggufs(
        _files(
            "a-Q8_0-00001-of-00002.gguf", "a-Q8_0-00002-of-00002.gguf", "b-F16-00001-of-00002.gguf"
        )
    )
    assert [(g.stem, g.quant, len(g.files)) for g in groups] == [("a-Q8_0", "Q8_0", 2)]
    assert mm == []


def test_resolution_rules():
    files = _files("m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-F32.gguf", "mmproj-m-F16.gguf", "x.md")
    r = resolve_files("o/r", files, None)
    assert (r.model.quant, r.mmproj.name, r.name) == ("Q4_K_M", "mmproj-m-F16.gguf", "o/r:Q4_K_M")
    assert resolve_files("o/r", files, "q8_0").model.files[0].name == "m-Q8_0.gguf"
    ud = resolve_files("o/r", _files("m-UD-Q4_K_XL.gguf", "m-Q8_0.gguf"), "Q4_K_XL")
    assert ud.model.files[0].name == "m-UD-Q4_K_XL.gguf"
    with pytest.raises(HubError, match=r"no Q4_K_M \(the default\); pick one of: Q6_K, Q8_0"):
        resolve_files("o/r", _files("m-Q6_K.gguf", "m-Q8_0.gguf"), None)
    with pytest.raises(HubError, match="no GGUF model files"):
        resolve_files("o/r", _files("mmproj-only.gguf"), None)
    with pytest.raises(HubError, match=r"no GGUF file nope\.gguf; models: Q4_K_M, Q8_0"):
        resolve_files("o/r", files, None, filename="nope.gguf")
