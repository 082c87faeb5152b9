"""Host buffers for mapped views (`offload.mapped`) on pages of their own: runs without a GPU
(the registration itself is exercised by the CUDA tests of mapped experts and split layers)."""

import itertools
import mmap

from localllm.offload.mapped import _own_pages


def test_mapped_buffers_take_pages_of_their_own():
    """Two small mapped buffers never share a page (the driver refuses to register a page
    twice): each is page-aligned and a whole number of pages, whatever the heap gives."""
    page = mmap.PAGESIZE
    held = [_own_pages(n) for n in (256, 17_000, page, page + 1, 3 * page)]
    spans = []
    for n, t in zip((256, 17_000, page, page + 1, 3 * page), held, strict=True):
        assert t.data_ptr() % page == 0 and t.numel() % page == 0 and t.numel() >= n
        spans.append((t.data_ptr(), t.data_ptr() + t.numel()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    held[1][:] = 7  # writable end to end
    assert int(held[1].sum()) == 7 * held[1].numel()
