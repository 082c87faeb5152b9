"""`localllm pull org/repo` on a repository of safetensors (no GGUF), against the fake Hub.

The repo is a real tiny `save_pretrained` folder (qwen2, three shards with an index) beside a
`consolidated.safetensors` and a README that are not the model's: exactly the index's shards and
the config, tokenizer and generation files come down, resumably and sha256-verified like GGUF
pulls; the pulled folder runs; `ls`, `-m` and `rm` see it as `org/repo:safetensors`.
"""

import hashlib
import json

import pytest
from huggingface_hub import constants

from localllm.app.cli import main
from localllm.app.hub.download import cached_model, pull
from localllm.app.hub.library import scan_library
from localllm.app.hub.quant import SAFETENSORS, HubError
from localllm.app.model_path import resolve_model
from tests.engine.hf_fixtures import save_tiny

REPO = "tiny-org/tiny-safetensors"
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "model.safetensors.index.json")  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers")
    return save_tiny("qwen2", tmp_path_factory.mktemp("st") / "qwen2", shards=True)


@pytest.fixture
def st_hub(hub, folder):
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    model = {**files, "consolidated.safetensors": b"\0" * 64, "README.md": b"# tiny\n"}
    hub.repos[REPO] = model
    hub.in_git |= {n for n in files if not n.endswith(".safetensors")}  # small files live in git
    return hub


def shards(folder) -> list[str]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


def fetched(hub) -> set[str]:
    return {path.rsplit("/", 1)[-1] for method, path, _ in hub.log if method == "GET"
            and "/resolve/" in path}  # fmt: skip


def test_pull_fetches_exactly_the_model_files_and_runs(st_hub, config, folder):
    got = pull(REPO, config=config)
    assert got.quant == SAFETENSORS and got.name == f"{REPO}:safetensors"
    assert got.path.is_dir() and got.path.name == got.revision
    assert fetched(st_hub) == {*SMALL_FILES, *shards(folder)}
    for name in fetched(st_hub):
        assert (got.path / name).read_bytes() == (folder / name).read_bytes()
    assert not (got.path / "consolidated.safetensors").exists()
    from localllm.engine import EngineArgs, LLMEngine, SamplingParams

    def greedy(path):
        e = LLMEngine(str(path), EngineArgs(precise=True))
        e.add_request("a", "Hello, world", SamplingParams(temperature=0, max_tokens=6))
        out = []
        while e.has_unfinished_requests():
            out = e.step() or out
        e.close()
        return out[0].outputs[0].token_ids

    assert greedy(got.path) == greedy(folder)
    # a second pull: nothing to fetch, found in the cache as verified
    again = pull(REPO, config=config)
    assert again.downloaded == 0 and again.path == got.path
    assert cached_model(config, REPO).path == got.path
    assert cached_model(config, REPO, SAFETENSORS).path == got.path


def test_dropped_shard_resumes_and_verifies(st_hub, config, folder, monkeypatch):
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64)
    name = shards(folder)[1]
    st_hub.drop_once.add(name)
    got = pull(REPO, config=config)
    ranges = [r for m, p, r in st_hub.log if m == "GET" and p.endswith(name)]
    assert len(ranges) == 2 and ranges[1].startswith("bytes=")
    want = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    assert hashlib.sha256((got.path / name).read_bytes()).hexdigest() == want


def test_sha256_mismatch_leaves_no_model(st_hub, config, folder):
    st_hub.bad_sha.add(shards(folder)[0])
    with pytest.raises(HubError, match="sha256 mismatch"):
        pull(REPO, config=config)
    assert cached_model(config, REPO) is None


def test_clear_errors(st_hub, config, folder):
    with pytest.raises(HubError, match="has no GGUF files but a safetensors model"):
        pull(REPO, "Q4_K_M", config=config)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors"
    broken = {**st_hub.repos[REPO], "model.safetensors.index.json": json.dumps(index).encode()}
    st_hub.repos["tiny-org/broken"] = broken
    with pytest.raises(HubError, match="names shards the repo lacks: model-00009-of-00009"):
        pull("tiny-org/broken", config=config)


def test_cli_pull_ls_run_rm(st_hub, config, capsys, monkeypatch):
    assert main(["pull", REPO, "--yes"]) == 0
    out, err = capsys.readouterr()
    assert f"{REPO}:safetensors: downloaded" in err
    path = out.strip()
    assert (
        resolve_model(REPO)
        == resolve_model(f"{REPO}:safetensors")
        == cached_model(config, REPO).path
    )
    assert str(resolve_model(REPO)) == path
    assert main(["ls"]) == 0
    rows = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines()[1:]}
    row = rows[f"{REPO}:safetensors"]
    assert row[1] == "safetensors" and row[4:7] == ["qwen2", "256", "hf-cache"]
    names = [m.name for m in scan_library(config.cache_dir)]
    assert f"{REPO}:safetensors" in names
    assert main(["run", "-m", f"{REPO}:safetensors", "-n", "4", "--temperature", "0",
                 "--no-chat", "Hello"]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip()
    assert main(["rm", f"{REPO}:safetensors", "--yes"]) == 0
    assert cached_model(config, REPO) is None
    assert f"{REPO}:safetensors" not in [m.name for m in scan_library(config.cache_dir)]


def test_user_folder_lists_a_save_pretrained_folder(tmp_path, folder, monkeypatch):
    import shutil

    shutil.copytree(folder, tmp_path / "models" / "my-qwen")
    (model,) = scan_library(tmp_path / "no-cache", [tmp_path / "models"])
    assert model.name == "my-qwen" and model.quant == SAFETENSORS
    assert model.path == tmp_path / "models" / "my-qwen" and model.architecture == "qwen2"
