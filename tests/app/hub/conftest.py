"""Fixtures for hub tests: tiny GGUF repos served by a loopback fake Hub, and a tmp HF cache."""

from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import constants

from localllm.app.hub.download import HubConfig
from tests.app.hub.fake_hub import FakeHub, start
from tests.engine.gguf_fixtures import write_gguf

REPO = "tiny-org/tiny-GGUF"


def make_gguf(
    path: Path, name: str, ctx: int = 256, arch: str = "llama", split: int = 0
) -> list[Path]:
    """A small valid GGUF (three tensors); with `split`, shards of `split` tensors each."""
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    tensors = {f"blk.{i}.w": rng.standard_normal((4, 8)).astype(np.float32) for i in range(3)}
    meta = {"general.name": name, f"{arch}.context_length": ctx}
    first = write_gguf(path, meta, tensors, arch=arch, split_max_tensors=split)
    if not split:
        return [first]
    return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))


@pytest.fixture
def repo_files(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("repo")
    files = {}
    for quant, ctx in (("Q4_K_M", 512), ("Q8_0", 1024), ("IQ4_XS", 256)):
        (p,) = make_gguf(d / f"tiny-{quant}.gguf", f"tiny {quant}", ctx)
        files[p.name] = p.read_bytes()
    for p in make_gguf(d / "tiny-F16.gguf", "tiny F16", 2048, split=1):
        files[p.name] = p.read_bytes()
    (p,) = make_gguf(d / "mmproj-tiny-f16.gguf", "projector", arch="clip")
    files[p.name] = p.read_bytes()
    files["README.md"] = b"# tiny\n"
    return files


@pytest.fixture
def hub(monkeypatch, tmp_path, repo_files):
    """A running fake Hub (REPO, a repo without GGUFs, one with only Q8_0); env aimed at it."""
    fake = FakeHub(
        repos={
            REPO: repo_files,
            "tiny-org/no-gguf": {"config.json": b"{}", "pytorch_model.bin": b"x" * 10},
            "tiny-org/only-q8": {"m-Q8_0.gguf": repo_files["tiny-Q8_0.gguf"]},
        }
    )
    server = start(fake)
    cache = tmp_path / "hf" / "hub"
    # huggingface_hub reads these at import; patch the module constants and the env for children.
    monkeypatch.setattr(constants, "ENDPOINT", fake.url)
    template = fake.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("LOCALLLM_MODEL_DIRS", "")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    yield fake
    server.shutdown()
    server.server_close()


@pytest.fixture
def config(hub) -> HubConfig:
    return HubConfig.current()
