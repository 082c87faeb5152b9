"""A model in the library is a verified model: sha256 before the blob goes in place, records
that survive restarts and die with any write, and re-verification of what has no record."""

import hashlib
import os
import subprocess
import sys
import textwrap
import time

from huggingface_hub import constants, hf_hub_download

from localllm.app.cli import main
from localllm.app.hub.download import cached_model, pull
from localllm.app.hub.library import scan_library
from tests.app.hub.conftest import REPO
from tests.app.hub.fake_hub import git_blob_sha1

FOLDER = f"models--{REPO.replace('/', '--')}"

# Run as `python DRIVER SIGNAL localllm-args...`: the real CLI, except that hashing a chunk that
# starts a GGUF file (the first chunk of a model's sha256 check) touches SIGNAL and then hangs,
# so the test can SIGKILL the process while it is verifying. Nothing else hashes GGUF bytes.
DRIVER = textwrap.dedent(
    """
    import hashlib, pathlib, sys, time

    real = hashlib.sha256

    class Hanging:
        def __init__(self, *args, **kwargs):
            self._h = real(*args, **kwargs)

        def update(self, data):
            self._h.update(data)
            if bytes(data[:4]) == b"GGUF":
                pathlib.Path(sys.argv[1]).touch()
                time.sleep(600)

        def __getattr__(self, name):
            return getattr(self._h, name)

    hashlib.sha256 = Hanging
    from localllm.app.cli import main

    sys.exit(main(sys.argv[2:]))
    """
)


def _resolve_gets(hub, name):
    return [e for e in hub.log if e[0] == "GET" and e[1].endswith("/" + name)]


def _ls(capsys) -> tuple[list[str], str]:
    """`localllm ls`: the names of the library's models on stdout (not the embedded default's),
    and stderr."""
    assert main(["ls"]) == 0
    out, err = capsys.readouterr()
    rows = [line.split() for line in out.splitlines()[1:]]
    return [r[0] for r in rows if "embedded" not in r[5:]], err


def _blob(config, name):
    return (config.cache_dir / FOLDER / "snapshots").glob(f"*/{name}").__next__().resolve()


def test_pull_killed_while_hashing_leaves_no_model_and_the_next_pull_verifies(
    hub, config, repo_files, tmp_path, capsys
):
    driver, signal = tmp_path / "driver.py", tmp_path / "hashing"
    driver.write_text(DRIVER)
    env = dict(os.environ, PYTHONSAFEPATH="1")
    proc = subprocess.Popen(
        [sys.executable, str(driver), str(signal), "pull", REPO, "--yes"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not signal.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the pull never started hashing"
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL: no cleanup handler runs
        proc.wait()
        proc.stderr.close()

    # Killed mid-hash: nothing is a model, not even an unverified one.
    assert cached_model(config, REPO) is None
    assert scan_library(config.cache_dir) == []
    names, err = _ls(capsys)
    assert names == [] and REPO not in err
    # The interrupted file's bytes are all there, under the partial name only.
    by_sha = {hashlib.sha256(d).hexdigest(): n for n, d in repo_files.items()}
    blobs = config.cache_dir / FOLDER / "blobs"
    sizes = {p: len(repo_files[by_sha[p.name[:64]]]) for p in blobs.glob("*.partial")}
    (partial,) = [p for p, size in sizes.items() if p.stat().st_size == size]
    interrupted = by_sha[partial.name[:64]]
    assert not (blobs / partial.name[:64]).exists()
    assert not list((config.cache_dir / FOLDER).glob(f"snapshots/*/{interrupted}"))

    hub.log.clear()
    assert main(["pull", REPO, "--yes"]) == 0
    out, err = capsys.readouterr()
    assert "already cached" not in err and "verified" in err
    assert not _resolve_gets(hub, interrupted)  # resumed from the complete partial: no bytes
    assert not partial.exists()
    got = cached_model(config, REPO)
    assert got is not None and out.strip() == str(got.path)
    assert got.path.read_bytes() == repo_files["tiny-Q4_K_M.gguf"]
    assert got.mmproj.read_bytes() == repo_files["mmproj-tiny-f16.gguf"]
    assert _ls(capsys)[0] == [f"{REPO}:Q4_K_M"]


def test_a_corrupt_byte_is_detected_and_the_file_fetched_again(hub, config, repo_files, capsys):
    name = "tiny-Q8_0.gguf"
    pull(REPO, "Q8_0", config=config)
    blob = _blob(config, name)
    with open(blob, "r+b") as f:
        f.seek(len(repo_files[name]) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))

    assert scan_library(config.cache_dir) == []
    assert cached_model(config, REPO, "Q8_0") is None
    names, err = _ls(capsys)
    assert names == [] and f"{REPO}:Q8_0" in err and "not verified" in err

    hub.log.clear()
    got = pull(REPO, "Q8_0", config=config)
    assert len(_resolve_gets(hub, name)) == 1  # the corrupt copy was replaced by a fresh one
    assert not _resolve_gets(hub, "mmproj-tiny-f16.gguf")  # the intact one was kept
    assert got.path.read_bytes() == repo_files[name]
    assert got.downloaded == len(repo_files[name])
    assert [m.name for m in scan_library(config.cache_dir)] == [f"{REPO}:Q8_0"]


def test_a_corrupt_file_offline_is_one_error_line_and_no_model(
    hub, config, repo_files, monkeypatch, capsys
):
    name = "tiny-Q8_0.gguf"
    pull(REPO, "Q8_0", config=config)
    blob = _blob(config, name)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n = len(hub.log)
    assert main(["pull", f"{REPO}:Q8_0", "--yes"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("localllm: error: ") and err.count("\n") == 1
    assert f"{REPO}/{name}: sha256 mismatch" in err and "HF_HUB_OFFLINE" in err
    assert len(hub.log) == n  # offline: no request
    assert cached_model(config, REPO, "Q8_0") is None
    assert _ls(capsys)[0] == []


def test_a_file_another_tool_downloaded_is_verified_once_without_downloading(
    hub, config, repo_files, capsys
):
    for name in ("tiny-Q8_0.gguf", "mmproj-tiny-f16.gguf"):
        hf_hub_download(REPO, name, cache_dir=config.cache_dir, endpoint=hub.url)
    # huggingface_hub does not hash what it downloads: not a ready model yet.
    assert scan_library(config.cache_dir) == []
    (unverified,) = scan_library(config.cache_dir, include_unverified=True)
    assert unverified.name == f"{REPO}:Q8_0" and not unverified.verified
    names, err = _ls(capsys)
    assert names == [] and f"{REPO}:Q8_0" in err and f"localllm pull {REPO}:Q8_0" in err

    hub.log.clear()
    assert main(["pull", f"{REPO}:Q8_0", "--yes"]) == 0
    assert "verified" in capsys.readouterr().err
    assert not [e for e in hub.log if e[0] == "GET" and "/resolve/" in e[1]]
    (model,) = scan_library(config.cache_dir)
    assert model.name == f"{REPO}:Q8_0" and model.verified
    assert model.path.read_bytes() == repo_files["tiny-Q8_0.gguf"]


def test_the_record_survives_a_restart_and_dies_with_a_write(hub, config, repo_files):
    name = "tiny-Q8_0.gguf"
    pull(REPO, "Q8_0", config=config)
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "localllm.app", "ls"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"{REPO}:Q8_0" in proc.stdout, proc.stderr

    # Same bytes, but the file was written since it was checked: check it again.
    blob = _blob(config, name)
    st = blob.stat()
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"{REPO}:Q8_0" not in proc.stdout
    assert f"{REPO}:Q8_0" in proc.stderr and "not verified" in proc.stderr

    hub.log.clear()
    seen = []
    got = pull(REPO, "Q8_0", config=config, progress=seen.append)
    assert got.downloaded == 0 and got.verified == len(repo_files[name])
    assert not [e for e in hub.log if e[0] == "GET" and "/resolve/" in e[1]]
    assert [p.filename for p in seen if p.phase == "verify" and p.finished] == [name]
    assert [m.name for m in scan_library(config.cache_dir)] == [f"{REPO}:Q8_0"]
    # Checked once: the next pull trusts the record.
    assert pull(REPO, "Q8_0", config=config).verified == 0


def test_progress_reports_the_sha256_check_of_every_file(hub, config, repo_files):
    seen = []
    got = pull(REPO, "Q8_0", config=config, progress=seen.append)
    checks = [p for p in seen if p.phase == "verify"]
    done = {p.filename: p.done for p in checks if p.finished}
    assert done == {n: len(repo_files[n]) for n in ("tiny-Q8_0.gguf", "mmproj-tiny-f16.gguf")}
    assert got.verified == got.downloaded == sum(done.values())


def test_rm_removes_an_unverified_model(hub, config, capsys):
    hf_hub_download(REPO, "tiny-IQ4_XS.gguf", cache_dir=config.cache_dir, endpoint=hub.url)
    assert main(["rm", f"{REPO}:IQ4_XS", "--yes"]) == 0
    assert "removed" in capsys.readouterr().err
    assert scan_library(config.cache_dir, include_unverified=True) == []


def test_a_damaged_partial_file_is_fetched_again_from_the_start(hub, config, repo_files):
    """A killed pull's partial file, complete but with one byte wrong, never becomes a blob."""
    name = "tiny-Q8_0.gguf"
    data = repo_files[name]
    etag = hashlib.sha256(data).hexdigest()
    blobs = config.cache_dir / FOLDER / "blobs"
    blobs.mkdir(parents=True)
    damaged = bytearray(data)
    damaged[len(data) // 3] ^= 0x10
    (blobs / f"{etag}.partial").write_bytes(bytes(damaged))

    got = pull(REPO, "Q8_0", config=config)
    assert [g[2] for g in _resolve_gets(hub, name)] == [None]  # one full GET, no Range
    assert got.path.read_bytes() == data
    assert got.downloaded == len(data) + len(repo_files["mmproj-tiny-f16.gguf"])
    assert not (blobs / f"{etag}.partial").exists()
    assert [m.name for m in scan_library(config.cache_dir)] == [f"{REPO}:Q8_0"]


def test_a_file_kept_in_git_is_checked_against_its_git_blob_sha1(hub, config, repo_files, capsys):
    """A small file stored in git has no LFS sha256: its ETag, the git blob sha1, is the check."""
    name = "tiny-Q8_0.gguf"
    hub.in_git.add(name)
    got = pull(REPO, "Q8_0", config=config)
    assert got.path.read_bytes() == repo_files[name]
    assert [m.name for m in scan_library(config.cache_dir)] == [f"{REPO}:Q8_0"]
    blob = _blob(config, name)
    assert blob.name == git_blob_sha1(repo_files[name])
    with open(blob, "r+b") as f:
        f.seek(7)
        f.write(b"\xff")
    names, err = _ls(capsys)
    assert names == [] and f"localllm pull {REPO}:Q8_0" in err
    hub.log.clear()
    assert pull(REPO, "Q8_0", config=config).path.read_bytes() == repo_files[name]
    assert len(_resolve_gets(hub, name)) == 1
