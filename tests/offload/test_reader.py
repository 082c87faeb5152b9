"""Plain reads: a range read back exactly, a short file a clear error, and the expert streamer's
reads cut into per-thread shares that cover every byte once, in order, about evenly."""

import os

import pytest

from localllm.offload.ranges import ByteRange
from localllm.offload.reader import READ_SHARE_MIN, pread_all, read_range, shares


def test_read_range_reads_the_bytes_and_refuses_past_the_end(tmp_path):
    path = tmp_path / "f.bin"
    data = os.urandom(100_000)
    path.write_bytes(data)
    assert read_range(ByteRange(str(path), 1234, 5000)).numpy().tobytes() == data[1234:6234]
    with pytest.raises(OSError, match="unexpected end of file"):
        read_range(ByteRange(str(path), 99_000, 5000))


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
@pytest.mark.parametrize("sizes", [[900_000, 900_000, 1_300_000], [100], [5 * READ_SHARE_MIN, 7]])
def test_shares_cover_every_byte_once_in_order(tmp_path, parts, sizes):
    path = tmp_path / "f.bin"
    data = os.urandom(sum(sizes) + 4096)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        out, segments, off = bytearray(sum(sizes)), [], 17  # segments back to back in `out`
        view, pos = memoryview(out), 0
        for n in sizes:
            segments.append((fd, view[pos : pos + n], off, str(path)))
            pos, off = pos + n, off + n + 3  # the file ranges need not touch
        cut = shares(segments, parts)
        total = sum(sizes)
        assert 1 <= len(cut) <= max(1, min(parts, total // READ_SHARE_MIN))
        lengths = [sum(len(v) for _, v, _, _ in share) for share in cut]
        assert sum(lengths) == total and max(lengths) - min(lengths) <= -(-total // len(cut))
        for share in cut:
            pread_all(share)
    finally:
        os.close(fd)
    want, off = b"", 17
    for n in sizes:
        want, off = want + data[off : off + n], off + n + 3
    assert bytes(out) == want
