"""The disk tier of a Hugging Face folder: tensors the engine holds in another form than the
shards store them (MoE experts stacked from per-expert tensors, blocks made by `--quantize`)
written once to a spill file, so the expert streaming reads them by byte range as it reads a
GGUF's (`offload.expert_reads`).

The file goes to `<folder>/.localllm/` (next to the weights, on their disk; for a Hugging Face
cache snapshot, beside the snapshots: `spill_dir`), else to the system temporary folder when the
folder is read-only. Its name is a hash of what made it (the shards'
names, sizes and modification times, `--quantize`, each tensor's name, type and shape), so a
later load of the same folder with the same settings maps it again instead of writing it; a
partial write never takes the final name (written beside it, then renamed).
"""

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from localllm.offload import ByteRange

log = logging.getLogger(__name__)

ALIGN = 4096  # each tensor starts on a page: reads of one expert stay page-aligned
SPILL_DIR = ".localllm"


def spill_key(folder: Path, shards: Iterable[str], quantize: str | None,
              tensors: Iterable[tuple[str, str, tuple[int, ...]]]) -> str:  # fmt: skip
    """A hash of everything the spilled bytes depend on."""
    h = hashlib.sha256()
    h.update(str(folder.resolve()).encode())
    for s in shards:
        st = os.stat(s)
        h.update(f"{Path(s).name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(f"quantize={quantize}".encode())
    for name, qtype, shape in tensors:
        h.update(f"{name}:{qtype}:{shape}".encode())
    return h.hexdigest()[:20]


def spill_dir(folder: Path) -> Path:
    """`<folder>/.localllm` where it can be written, else the temporary folder. A snapshot of
    the Hugging Face cache (`models--org--name/snapshots/<commit>`) keeps its spill beside the
    snapshots, in `models--org--name/.localllm/<commit>`: the snapshot holds the repo's files
    only (`localllm rm` deletes that folder with the revision)."""
    own = folder / SPILL_DIR
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        own = folder.parent.parent / SPILL_DIR / folder.name
    try:
        own.mkdir(parents=True, exist_ok=True)
        if os.access(own, os.W_OK):
            return own
    except OSError:
        pass
    return Path(tempfile.gettempdir())


def write_spill(
    path: Path, sizes: dict[str, int], make: Callable[[str], memoryview]
) -> dict[str, ByteRange]:
    """Each tensor's bytes (`make(name)`, `sizes[name]` long) at its page-aligned offset in
    `path`; an existing file of the right size is kept as it is."""
    ranges, offset = {}, 0
    for name, n in sizes.items():
        ranges[name] = ByteRange(str(path), offset, n)
        offset = -(-(offset + n) // ALIGN) * ALIGN
    if path.is_file() and path.stat().st_size == offset:
        log.info("disk tier: %d tensors mapped from %s", len(sizes), path)
        return ranges
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        with open(tmp, "wb") as f:
            for name, rng in ranges.items():
                f.seek(rng.offset)
                data = make(name)
                if len(data) != rng.nbytes:
                    raise ValueError(f"{name}: {len(data)} bytes, not {rng.nbytes}")
                f.write(data)
            f.truncate(offset)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("disk tier: %d tensors (%.1f MiB) written to %s", len(sizes), offset / 2**20, path)
    return ranges
