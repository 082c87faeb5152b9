"""Hub search and quant listing against the loopback fake Hub."""

import pytest

from localllm.app.hub.download import HubConfig
from localllm.app.hub.quant import HubError
from localllm.app.hub.search import QuantChoice, repo_quants, search_models
from tests.app.hub.conftest import REPO


def test_search_lists_only_gguf_repos_most_downloaded_first(hub, config):
    hub.repos["other-org/tiny-gguf-2"] = {"m-Q4_0.gguf": b"x"}
    hub.downloads.update({REPO: 5, "other-org/tiny-gguf-2": 50, "tiny-org/no-gguf": 500})
    hits = search_models("TINY", config)
    # no-gguf matches the name but has no GGUF files: filtered out by the Hub's gguf tag.
    assert [h.repo_id for h in hits] == ["other-org/tiny-gguf-2", REPO, "tiny-org/only-q8"]
    assert (hits[0].downloads, hits[0].likes) == (50, 5)
    assert hits[0].last_modified.startswith("2026-11-01T12:00:00")
    assert [h.repo_id for h in search_models("only", config)] == ["tiny-org/only-q8"]
    assert search_models("nothing-like-this", config) == []
    assert search_models("  ", config) == []
    assert len(search_models("tiny", config, limit=1)) == 1


def test_repo_quants_groups_shards_and_pairs_the_mmproj(hub, config, repo_files):
    quants = repo_quants(REPO, config)
    by_tag = {q.quant: q for q in quants}
    assert set(by_tag) == {"Q4_K_M", "Q8_0", "IQ4_XS", "F16"}
    f16 = by_tag["F16"]
    assert len(f16.files) > 1 and all("-of-" in n for n in f16.files)
    assert f16.size == sum(len(repo_files[n]) for n in f16.files)
    assert by_tag["Q8_0"] == QuantChoice(
        "Q8_0", len(repo_files["tiny-Q8_0.gguf"]), ("tiny-Q8_0.gguf",), "mmproj-tiny-f16.gguf"
    )
    assert [q.size for q in quants] == sorted(q.size for q in quants)


def test_errors_are_clear(hub, config):
    with pytest.raises(HubError, match="no GGUF files"):
        repo_quants("tiny-org/no-gguf", config)
    with pytest.raises(HubError, match="no such model repository"):
        repo_quants("tiny-org/missing", config)
    offline = HubConfig(config.endpoint, config.cache_dir, offline=True)
    with pytest.raises(HubError, match="offline mode"):
        search_models("tiny", offline)
    dead = HubConfig("http://127.0.0.1:9", config.cache_dir)
    with pytest.raises(HubError, match="cannot reach"):
        search_models("tiny", dead)
