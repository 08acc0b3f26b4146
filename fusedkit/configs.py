"""Launch configurations, all in one place.

Elementwise kernels are bandwidth-bound: a tile only needs enough bytes in
flight per program and 16-byte accesses. Matmul autotune configs will live here
too.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Elements per program on the contiguous 1-D path.
BLOCK_1D = 1024
#: Elements per program for a row-major 2-D tile (a broadcast bias, a strided slice).
TILE_ELEMS_2D = 2048
#: Widest column block; wider rows take several programs.
MAX_BLOCK_C = 1024
#: Square tile side when some operand is transposed: both layouts read whole
#: 128-byte lines of a 64-wide fp32 tile edge, and the layout change goes through
#: shared memory.
TRANSPOSED_TILE = 64
#: Warps per program for every elementwise tile above.
ELEMENTWISE_WARPS = 4


@dataclass(frozen=True)
class TileConfig:
    block_r: int
    block_c: int
    num_warps: int


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def elementwise_tile(size_r: int, size_c: int, transposed: bool) -> TileConfig:
    """Tile shape for a ``size_r x size_c`` plane (``size_r == 1`` is the 1-D path)."""
    if size_r == 1:
        return TileConfig(1, min(BLOCK_1D, _pow2_at_least(size_c)), ELEMENTWISE_WARPS)
    if transposed:
        return TileConfig(TRANSPOSED_TILE, TRANSPOSED_TILE, ELEMENTWISE_WARPS)
    block_c = min(MAX_BLOCK_C, _pow2_at_least(size_c))
    block_r = min(_pow2_at_least(size_r), max(1, TILE_ELEMS_2D // block_c))
    return TileConfig(block_r, block_c, ELEMENTWISE_WARPS)
