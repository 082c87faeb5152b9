"""Drop the PTX from a CUDA shared library's fat binaries, keeping their SASS, to carry it smaller.

llama.cpp's CUDA build for one architecture (`-DCMAKE_CUDA_ARCHITECTURES=90`) embeds, per
translation unit, a fat binary holding both the sm_90 machine code (an ELF cubin) and the
compute_90 PTX it came from; the driver runs the cubin on an sm_90 GPU (H100, H200) and needs
the PTX only for a newer architecture. The PTX is half of `libggml-cuda.so`. This rewrites each
fat binary in place: its header's size shrinks to the entries kept, the cubin moves up behind the
header, and the bytes freed are zeroed (xz packs them to nothing), so no offset in the file
changes. A fat binary without a cubin of the wanted architecture is left whole.

    python tests/perf/prune_fatbin.py LIB.so [--arch 90] [-o OUT.so]   # (default: in place)

Layout (CUDA's fatbinary format, as `cuobjdump` reads it): a 16-byte header (magic 0xBA55ED50,
u16 version, u16 header size, u64 size of the entries), then entries, each a header (u16 kind:
1 PTX, 2 ELF; u16 version; u32 header size; u64 payload size; ...; u32 at offset 28 holding the
architecture, e.g. 90) followed by its payload.
"""

import argparse
import struct
import subprocess
import sys
from pathlib import Path

MAGIC = 0xBA55ED50
PTX, ELF = 1, 2


def section(path: Path, name: str) -> tuple[int, int]:
    """(file offset, size) of ELF section `name` (readelf's table)."""
    out = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    for line in out.splitlines():
        if "]" in line and line.split("]", 1)[1].split()[:1] == [name]:
            f = line.split("]", 1)[1].split()
            return int(f[3], 16), int(f[4], 16)
    raise SystemExit(f"prune_fatbin: {path} has no {name} section")


def entries(buf: bytes, at: int) -> tuple[int, list[tuple[int, int, int, int]]]:
    """(end, [(kind, arch, start, length)]) of the fat binary at `at`."""
    magic, _ver, hsize, size = struct.unpack_from("<IHHQ", buf, at)
    assert magic == MAGIC
    out, e, end = [], at + hsize, at + hsize + size
    while e < end:
        kind, _v, ehsize, psize = struct.unpack_from("<HHIQ", buf, e)
        arch = struct.unpack_from("<I", buf, e + 28)[0]
        out.append((kind, arch, e, ehsize + psize))
        e += ehsize + psize
    if e != end:
        raise SystemExit(f"prune_fatbin: entries overrun the fat binary at {at:#x}")
    return end, out


def prune(data: bytearray, offset: int, size: int, arch: int) -> tuple[int, int, int]:
    """Prune every fat binary in data[offset:offset+size]; (fat binaries, pruned, bytes freed)."""
    pos, end, n, pruned, freed = offset, offset + size, 0, 0, 0
    while pos + 16 <= end:
        if struct.unpack_from("<I", data, pos)[0] != MAGIC:
            pos += 8  # fat binaries are 8-byte aligned; padding between them
            continue
        n += 1
        stop, ents = entries(data, pos)
        keep = [x for x in ents if x[0] == ELF and x[1] == arch]
        if keep and len(keep) < len(ents):
            hsize = struct.unpack_from("<H", data, pos + 6)[0]
            body = b"".join(bytes(data[s : s + ln]) for _k, _a, s, ln in keep)
            data[pos + hsize : stop] = body + bytes(stop - pos - hsize - len(body))
            struct.pack_into("<Q", data, pos + 8, len(body))
            pruned += 1
            freed += stop - pos - hsize - len(body)
        pos = stop
    return n, pruned, freed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lib", type=Path)
    ap.add_argument("--arch", type=int, default=90, help="the cubin architecture kept (90)")
    ap.add_argument("-o", "--output", type=Path, help="write here (default: in place)")
    a = ap.parse_args(argv)
    offset, size = section(a.lib, ".nv_fatbin")
    data = bytearray(a.lib.read_bytes())
    n, pruned, freed = prune(data, offset, size, a.arch)
    (a.output or a.lib).write_bytes(bytes(data))
    print(f"{a.lib.name}: {n} fat binaries, {pruned} pruned to sm_{a.arch} only, "
          f"{freed / 2**20:.1f} MiB zeroed")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
