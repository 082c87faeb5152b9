"""The local library: listing the HF cache and folders, finding and removing one model."""

import pytest

from localllm.app.hub.download import cached_model, pull
from localllm.app.hub.library import find_model, remove_model, scan_library
from localllm.app.hub.quant import HubError
from tests.app.hub.conftest import REPO, make_gguf


def test_ls_reports_header_facts_and_sizes(hub, config, repo_files, tmp_path):
    pull(REPO, "Q8_0", config=config)
    pull(REPO, "F16", config=config)
    folder = tmp_path / "mine"
    folder.mkdir()
    (loose,) = make_gguf(folder / "loose-model.gguf", "loose", ctx=4096, arch="qwen2")
    models = {m.name: m for m in scan_library(config.cache_dir, [folder])}
    assert set(models) == {f"{REPO}:Q8_0", f"{REPO}:F16", "loose-model"}
    q8 = models[f"{REPO}:Q8_0"]
    assert (q8.quant, q8.architecture, q8.context_length) == ("Q8_0", "llama", 1024)
    assert q8.size == len(repo_files["tiny-Q8_0.gguf"]) and q8.location == "hf-cache"
    assert q8.mmproj.name == "mmproj-tiny-f16.gguf" and q8.repo == REPO
    f16 = models[f"{REPO}:F16"]
    shards = [n for n in repo_files if n.startswith("tiny-F16-")]
    assert len(f16.paths) == 3 and f16.size == sum(len(repo_files[n]) for n in shards)
    assert f16.context_length == 2048
    mine = models["loose-model"]
    assert (mine.architecture, mine.context_length, mine.quant) == ("qwen2", 4096, None)
    assert mine.path == loose and mine.location == str(folder)


def test_find_model_by_name_any_case(hub, config):
    pull(REPO, "Q8_0", config=config)
    pull(REPO, "IQ4_XS", config=config)
    models = scan_library(config.cache_dir)
    assert find_model(f"{REPO.upper()}:q8_0", models).quant == "Q8_0"
    with pytest.raises(HubError, match="several models"):
        find_model(REPO, models)
    with pytest.raises(HubError, match=f"no model named nope.*{REPO}:IQ4_XS"):
        find_model("nope", models)


def test_rm_removes_one_model_and_keeps_the_others(hub, config, repo_files):
    pull(REPO, "Q8_0", config=config)
    pull(REPO, "Q4_K_M", config=config)
    models = scan_library(config.cache_dir)
    freed = remove_model(find_model(f"{REPO}:Q8_0", models), config.cache_dir)
    assert freed == len(repo_files["tiny-Q8_0.gguf"])
    left = scan_library(config.cache_dir)
    assert [m.name for m in left] == [f"{REPO}:Q4_K_M"]
    kept = cached_model(config, REPO, "Q4_K_M")
    assert kept.path.read_bytes() == repo_files["tiny-Q4_K_M.gguf"]
    assert kept.mmproj.read_bytes() == repo_files["mmproj-tiny-f16.gguf"]  # still shared
    assert cached_model(config, REPO, "Q8_0") is None
    # The last model goes through the cache API: the whole revision disappears.
    remove_model(left[0], config.cache_dir)
    assert scan_library(config.cache_dir) == []
    assert not list(config.cache_dir.rglob("blobs/*"))


def test_rm_refuses_a_loose_file(tmp_path):
    make_gguf(tmp_path / "loose.gguf", "loose")
    (model,) = scan_library(tmp_path / "no-cache", [tmp_path])
    with pytest.raises(HubError, match="not in the Hugging Face cache"):
        remove_model(model, tmp_path / "no-cache")
    assert (tmp_path / "loose.gguf").is_file()
