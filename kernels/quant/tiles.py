"""Row tiling for the per-call dequant paths: bound the float32 scratch, keep GEMMs efficient."""

from collections.abc import Iterator

# ~1M float32 weights (4 MiB) per tile: big enough for an efficient GEMM, small next to the model.
TILE_ELEMENTS = 1 << 20
TILE_ALIGN = 64  # int4pack row slices must start at multiples of 64


def row_tiles(n_rows: int, n_cols: int, align: int = TILE_ALIGN) -> Iterator[tuple[int, int]]:
    """(start, stop) row ranges covering n_rows, each ~TILE_ELEMENTS and `align`-aligned."""
    rows = max(align, TILE_ELEMENTS // max(n_cols, 1) // align * align)
    for start in range(0, n_rows, rows):
        yield start, min(start + rows, n_rows)
