"""Pulling GGUF repos from a loopback fake Hub into a tmp Hugging Face cache."""

import hashlib
import shutil
from collections import namedtuple

import pytest
from huggingface_hub import constants

from localllm.app.hub import download
from localllm.app.hub.download import HubConfig, cached_model, pull
from localllm.app.hub.quant import HubError
from localllm.engine.gguf import open_gguf
from tests.app.hub.conftest import REPO


def _gets(hub, name):
    return [(m, r) for m, p, r in hub.log if m == "GET" and p.endswith("/" + name)]


def _blobs(config):
    return sorted(p.name for p in config.cache_dir.rglob("blobs/*"))


def test_default_quant_is_q4_k_m_with_mmproj(hub, config, repo_files):
    got = pull(REPO, config=config)
    assert got.name == f"{REPO}:Q4_K_M" and got.quant == "Q4_K_M"
    assert [p.name for p in got.paths] == ["tiny-Q4_K_M.gguf"]
    assert got.path.read_bytes() == repo_files["tiny-Q4_K_M.gguf"]
    assert got.mmproj.name == "mmproj-tiny-f16.gguf"
    assert got.mmproj.read_bytes() == repo_files["mmproj-tiny-f16.gguf"]
    assert str(got.path).startswith(str(config.cache_dir))
    assert got.downloaded == len(repo_files["tiny-Q4_K_M.gguf"]) + len(
        repo_files["mmproj-tiny-f16.gguf"]
    )
    # Nothing else was fetched: not the other quants, not the README.
    fetched = {p.rsplit("/", 1)[-1] for m, p, _ in hub.log if m == "GET" and "/resolve/" in p}
    assert fetched == {"tiny-Q4_K_M.gguf", "mmproj-tiny-f16.gguf"}


@pytest.mark.parametrize("tag", ["q8_0", "Q8_0", "iq4_xs"])
def test_quant_tag_is_case_insensitive(hub, config, repo_files, tag):
    got = pull(REPO, tag, config=config)
    assert got.quant == tag.upper()
    assert got.path.read_bytes() == repo_files[f"tiny-{tag.upper()}.gguf"]


def test_second_pull_downloads_nothing(hub, config):
    pull(REPO, "Q8_0", config=config)
    n = len(hub.log)
    again = pull(REPO, "Q8_0", config=config)
    assert again.downloaded == 0
    assert not [e for e in hub.log[n:] if e[0] == "GET" and "/resolve/" in e[1]]


def test_split_gguf_fetches_every_shard_and_opens_as_one(hub, config, repo_files):
    got = pull(REPO, "f16", config=config)
    names = sorted(n for n in repo_files if n.startswith("tiny-F16-"))
    assert len(names) == 3 and [p.name for p in got.paths] == names
    for p in got.paths:
        assert p.read_bytes() == repo_files[p.name]
    with open_gguf(got.path) as m:
        assert len(m.shards) == 3 and len(m.tensors) == 3
        assert m.get("llama.context_length") == 2048


def test_progress_callback_sees_every_byte(hub, config, repo_files):
    seen = []
    pull(REPO, "Q8_0", config=config, progress=seen.append)
    by_file = {}
    for p in seen:
        by_file.setdefault(p.filename, []).append(p)
    size = len(repo_files["tiny-Q8_0.gguf"])
    last = by_file["tiny-Q8_0.gguf"][-1]
    assert last.done == size and last.total == size and last.finished and last.speed > 0
    assert set(by_file) == {"tiny-Q8_0.gguf", "mmproj-tiny-f16.gguf"}


def test_dropped_connection_resumes_with_range_and_matches_sha(
    hub, config, repo_files, monkeypatch
):
    # Small chunks so the bytes before the cut reach the file (a chunk is 10 MB by default).
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64)
    name = "tiny-Q4_K_M.gguf"
    hub.drop_once.add(name)
    got = pull(REPO, config=config)
    data = repo_files[name]
    gets = _gets(hub, name)
    # First GET cut half way, second asks for the rest only.
    assert gets[0] == ("GET", None)
    assert len(gets) == 2 and gets[1][1].startswith("bytes=")
    resumed_at = int(gets[1][1][len("bytes=") : -1])
    assert 0 < resumed_at <= len(data) // 2
    assert hashlib.sha256(got.path.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()


def test_sha256_mismatch_is_an_error_and_leaves_no_model(hub, config):
    hub.bad_sha.add("tiny-Q8_0.gguf")
    with pytest.raises(HubError, match="sha256 mismatch"):
        pull(REPO, "Q8_0", config=config)
    assert cached_model(config, REPO, "Q8_0") is None
    assert not list(config.cache_dir.rglob("tiny-Q8_0.gguf"))
    assert not any(b for b in _blobs(config) if not b.startswith("."))


@pytest.mark.parametrize(
    ("repo", "quant", "message"),
    [
        ("tiny-org/no-gguf", None, r"no GGUF model files \(it has: config.json, pytorch_model"),
        (REPO, "Q3_K_S", "no Q3_K_S quant; available: F16, IQ4_XS, Q4_K_M, Q8_0"),
        ("tiny-org/missing", None, "tiny-org/missing: no such model repository"),
        ("tiny-org/only-q8", "Q4_K", "no Q4_K quant; available: Q8_0"),
    ],
)
def test_clear_errors(hub, config, repo, quant, message):
    with pytest.raises(HubError, match=message):
        pull(repo, quant, config=config)
    assert not list(config.cache_dir.rglob("*.gguf"))


def test_single_model_repo_without_q4_k_m_uses_what_it_has(hub, config):
    assert pull("tiny-org/only-q8", config=config).quant == "Q8_0"


def test_offline_uses_cache_or_says_it_cannot(hub, config, monkeypatch):
    pull(REPO, "Q8_0", config=config)
    n = len(hub.log)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    offline = HubConfig.current()
    assert offline.offline
    got = pull(REPO, "q8_0", config=offline)
    assert got.quant == "Q8_0" and got.path.is_file()
    with pytest.raises(
        HubError, match=r"offline mode \(HF_HUB_OFFLINE\).*Q4_K_M is not in the cache"
    ):
        pull(REPO, "Q4_K_M", config=offline)
    assert len(hub.log) == n  # no request at all while offline


def test_disk_space_check_refuses_before_downloading(hub, config, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(HubError, match="not enough disk space"):
        pull(REPO, config=config)
    assert not [e for e in hub.log if "/resolve/" in e[1]]
    assert not list(config.cache_dir.rglob("*.gguf"))


def test_disk_margin_counts_only_missing_files(hub, config, monkeypatch, repo_files):
    pull(REPO, "Q8_0", config=config)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1, 0, download.DISK_MARGIN))
    assert pull(REPO, "Q8_0", config=config).downloaded == 0  # all cached: needs 0 bytes


def test_failed_shard_discards_the_shards_already_fetched(hub, config, repo_files):
    shards = sorted(n for n in repo_files if n.startswith("tiny-F16-"))
    hub.bad_sha.add(shards[1])
    with pytest.raises(HubError, match=f"{shards[1]}: sha256 mismatch"):
        pull(REPO, "F16", config=config)
    assert [e[1].rsplit("/", 1)[-1] for e in hub.log if e[0] == "GET" and "/resolve/" in e[1]] == [
        shards[0],
        shards[1],
    ]
    assert not list(config.cache_dir.rglob("*.gguf"))
    assert not any(b for b in _blobs(config) if not b.startswith("."))


def test_progress_line():
    from localllm.app.hub.progress import Progress, render

    line = render(Progress("m.gguf", 12_300_000, 45_600_000, 5_100_000.0, 65.3))
    assert line == "m.gguf  12.3 MB / 45.6 MB   26%  5.1 MB/s  ETA 01:05"
