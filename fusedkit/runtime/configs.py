"""Launch configurations, all in one place.

Elementwise kernels are bandwidth-bound: a tile only needs enough bytes in
flight per program and 16-byte accesses. Matmul autotune configs live here
too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import settings

# (The elementwise rows: measured with benchmarks/tile_sweep.py.)
#: Elements per program on the contiguous 1-D path (4- and 8-byte results).
BLOCK_1D = 1024
#: The same for 1- and 2-byte results: 1024 is fastest at every size since the kernel's
#: prologue lost its divisions (H200, bf16: gelu_mul at 2^28 4% faster than with 4096;
#: ``benchmarks/tile_sweep.py`` measures it again).
BLOCK_1D_NARROW = 1024
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

#: Compiler options of every fusedkit launch. The activations' polynomials are written for
#: fused multiply-adds, which Triton 3.10 stops forming by default: without them bf16
#: gelu_mul takes 1944 SASS instructions for sm_90 against 1552 (2^28 elements, Triton 3.9).
COMPILER_OPTIONS = dict(enable_fp_fusion=True)


@dataclass(frozen=True)
class TileConfig:
    block_r: int
    block_c: int
    num_warps: int


def pow2_at_least(n: int) -> int:
    """The least power of two >= ``n`` (n >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers (not ``triton.cdiv``: a ConstexprFunction on Triton 3.9,
    some microseconds a call on the host)."""
    return -(-a // b)


def elementwise_tile(size_r: int, size_c: int, transposed: bool, itemsize: int = 4) -> TileConfig:
    """Tile shape for a ``size_r x size_c`` plane (``size_r == 1`` is the 1-D path) of a
    result with ``itemsize`` bytes an element."""
    if size_r == 1:
        block = BLOCK_1D_NARROW if itemsize <= 2 else BLOCK_1D
        return TileConfig(1, min(block, pow2_at_least(size_c)), ELEMENTWISE_WARPS)
    if transposed:
        return TileConfig(TRANSPOSED_TILE, TRANSPOSED_TILE, ELEMENTWISE_WARPS)
    block_c = min(MAX_BLOCK_C, pow2_at_least(size_c))
    block_r = min(pow2_at_least(size_r), max(1, TILE_ELEMS_2D // block_c))
    return TileConfig(block_r, block_c, ELEMENTWISE_WARPS)


# --- matmul -------------------------------------------------------------------

#: Tile of the interpreter (CPU) runs: small, so tests stay fast; tl.dot needs >= 16.
MATMUL_INTERPRETER_TILE = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, DOT=True, SPLIT_K=1)
#: Programs along M that share a band of B before moving on (L2 reuse).
MATMUL_GROUP_M = 8
#: The most rows a gated MLP's gate and up projections run as one GEMM (the gated epilogue) for;
#: more run as two cuBLAS GEMMs and the registry's gate. With two accumulators the one GEMM was
#: up to 1.2x faster than eager's two GEMMs, SiLU and mul at M <= 64 (H200, LLaMA-7B's widths,
#: bf16, triton 3.6), and slower than two cuBLAS GEMMs and the gate from M = 256 (docs/matmul.md).
GATED_GEMM_MAX_M = 64
#: Largest M bucket: every M above it shares one tuning result.
MATMUL_MAX_M_BUCKET = 8192


#: Autotune tiles for M buckets above SMALL_M_BUCKET, as (BLOCK_M, BLOCK_N, BLOCK_K,
#: stages, warps): big square-ish tiles with 3-4 stages feed wgmma; the last fits fp64
#: operands in shared memory when the others do not (the autotuner skips configs that fail).
MATMUL_LARGE_M_TILES = (
    (128, 256, 64, 3, 8),
    (256, 128, 64, 3, 8),
    (128, 128, 64, 4, 8),
    (128, 128, 64, 4, 4),
    (64, 256, 64, 4, 4),
    (64, 128, 128, 3, 4),
    (64, 64, 128, 4, 4),
    (64, 64, 32, 2, 4),
)
#: Decode-sized M (<= SMALL_M_BUCKET): the weight stream is the cost, so narrow N tiles
#: spread it over more SMs (N = 4096 / 32 = 128 programs for 132 SMs) and long K steps
#: keep each program's loads in flight. The last fits fp64. No 64-row tiles: with them
#: M = 64, N = K = 4096 bf16 ran 13% slower (H200; current figures: docs/results.md).
MATMUL_DECODE_TILES = (
    (16, 32, 256, 4, 4),
    (16, 64, 256, 4, 4),
    (32, 64, 128, 4, 4),
    (16, 128, 128, 4, 4),
    (16, 32, 32, 2, 4),
)
#: Exact fp32 (TF32 off) and fp64 at decode-sized M: ``tl.dot`` without tensor cores is
#: an FMA loop over at least 16 rows; these tiles multiply and sum over K instead
#: (``DOT=False``), with as few rows as M needs. Same tuple layout.
#: Fewer than 16 rows: from 16 up in every dimension Triton rewrites the multiply-and-sum
#: into a TF32 ``tl.dot``. The narrow 1-row tiles give N = 4096 128 or 256 programs for
#: 132 SMs (a 64-wide one gives 64): fp32 ``linear_relu`` at M = 1, K = N = 4096 runs
#: 1.3x as fast as cuBLAS (H200; ``python -m fusedkit bench --matmul`` measures it again).
MATMUL_REDUCE_TILES = (
    (1, 64, 128, 3, 4),
    (1, 128, 64, 3, 4),
    (1, 32, 256, 3, 4),
    (1, 16, 512, 3, 4),
    (2, 64, 64, 3, 4),
    (4, 64, 64, 3, 4),
    (8, 32, 64, 3, 4),
)
#: M buckets at or below this tune over the decode-sized tiles; larger M over the
#: others, so neither pays for compiling the rest.
SMALL_M_BUCKET = 64

#: Split-K tiles, as (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, SPLIT_K): SPLIT_K programs
#: share a tile's K range and the last to finish sums their partial accumulators (a
#: workspace of SPLIT_K x M x N) and runs the epilogue. For grids of fewer tiles than
#: SMs: bf16 M = 64, N = K = 4096 has 64 tiles of 64 x 64 for 132 SMs. Decode-sized M; the
#: last, 64 x 128 x 128 with 8 warps, runs there 4% faster than the best tile without it (H200):
MATMUL_SPLIT_K_TILES = (
    (16, 64, 128, 4, 4, 4),
    (32, 64, 128, 4, 4, 4),
    (64, 64, 64, 4, 4, 4),
    (64, 128, 64, 4, 4, 4),
    (64, 64, 128, 3, 4, 2),
    (64, 128, 128, 3, 8, 4),
)
#: Exact fp32 / fp64 (``ieee``) at M buckets of 32 and 64: tall FMA tiles split over K, so the
#: CUDA cores get 4 to 8 times the warps: at M = 64, N = K = 4096 4 splits take half the time
#: unsplit takes (H200; docs/design.md). (The same tiles unsplit were no faster than the decode
#: tiles: not kept.)
MATMUL_EXACT_SPLIT_K_TILES = (
    (64, 32, 32, 3, 4, 4),
    (64, 32, 32, 3, 4, 8),
    (64, 64, 32, 3, 8, 4),
    (32, 32, 64, 3, 4, 4),
)
#: The smallest M bucket that tunes over ``MATMUL_EXACT_SPLIT_K_TILES``.
EXACT_TALL_M_BUCKET = 32
#: M buckets above SMALL_M_BUCKET up to this one also try split-K large tiles (M = 512,
#: N = 4096: 128 tiles of 128 x 128 for 132 SMs; without split-K 0.89x cuBLASLt's epilogue
#: on the H200; current figures: docs/results.md).
SPLIT_K_MAX_M_BUCKET = 512
MATMUL_MID_M_SPLIT_K_TILES = ((128, 128, 64, 4, 8, 2), (128, 256, 64, 3, 8, 2), (64, 128, 64, 4, 4, 2))
#: float32 at M buckets above SMALL_M_BUCKET (pointer kernel), beside the tiles above:
#: 32-wide K steps, so three or four stages fit shared memory with 4-byte operands (most
#: tiles above do not fit fp32 tf32x3 on the H200: OutOfResources). These fit sm_90's
#: shared memory in the tf32x3 mode (checked at compile time: ``tests/test_codegen.py``);
#: with them the matmul report's fp32 M = 512 (row-major ``b``) runs 1.5x as fast as without
#: (H200; ``python -m fusedkit bench --matmul`` measures it again).
MATMUL_FP32_TILES = (
    (128, 128, 32, 3, 8, 1),
    (128, 128, 32, 4, 8, 1),
    (128, 128, 32, 3, 8, 2),
    (64, 128, 32, 4, 4, 1),
    (128, 64, 32, 4, 4, 1),
    (64, 256, 32, 3, 8, 1),
)
#: Largest split-K workspace (SPLIT_K x M x N accumulators) a config may need; configs
#: above it are not tried. Like cuBLAS's workspace, it is kept per device and stream.
SPLIT_K_WORKSPACE_BYTES = 32 * 2**20
_SPLIT_TILES = MATMUL_SPLIT_K_TILES + MATMUL_EXACT_SPLIT_K_TILES + MATMUL_MID_M_SPLIT_K_TILES
#: The smallest (BLOCK_M, BLOCK_N) of any tile that may run split-K (the interpreter's too,
#: which tests split): sizes the arrival counters, one per output tile.
SPLIT_K_MIN_TILE = tuple(
    min([t[i] for t in _SPLIT_TILES + MATMUL_FP32_TILES if t[5] > 1] + [MATMUL_INTERPRETER_TILE[k]])
    for i, k in ((0, "BLOCK_M"), (1, "BLOCK_N"))
)


def _config(tile, dot: bool = True):
    from triton import Config

    bm, bn, bk, stages, warps, *split = tile
    return Config(
        dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=MATMUL_GROUP_M, DOT=dot, SPLIT_K=split[0] if split else 1),
        num_stages=stages,
        num_warps=warps,
    )


def tile_of(config) -> tuple:
    """A config as (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, SPLIT_K)."""
    kw = config.kwargs
    return kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], config.num_stages, config.num_warps, kw["SPLIT_K"]


def _with_split(tiles) -> set:
    return {t if len(t) == 6 else (*t, 1) for t in tiles}


def matmul_configs():
    """Autotune candidates for Hopper (H100/H200), bf16/fp16 first: every tile set
    (``prune_matmul_configs`` keeps those for the call's M bucket and precision)."""
    dot_tiles = MATMUL_LARGE_M_TILES + MATMUL_DECODE_TILES + _SPLIT_TILES + MATMUL_FP32_TILES
    return [_config(t) for t in dot_tiles] + [_config(t, dot=False) for t in MATMUL_REDUCE_TILES]


def reduce_tiles_apply(precision: str, dtype: torch.dtype) -> bool:
    """Whether a call at decode-sized M tunes over the multiply-and-sum tiles: fp32 / fp64
    unless TF32. They use no ``tl.dot``, so they are fp32's own math in the tf32x3 mode too,
    and at M = 1 the faster: fp32 ``linear_relu`` at M = 1, N = K = 4096 outruns torch with
    them on the H200, where tf32x3's 16-row dot tiles alone run at about half torch's speed
    (``MATMUL_REDUCE_TILES``)."""
    return dtype in (torch.float32, torch.float64) and precision != "tf32"


def _candidate_tiles(bucket: int, precision: str, dtype: torch.dtype) -> tuple[set, set]:
    """(dot tiles, multiply-and-sum tiles) that tuning tries for an M bucket, split-K included."""
    if bucket > SMALL_M_BUCKET:
        mid = bucket <= SPLIT_K_MAX_M_BUCKET  # split-K tiles only up to here
        split = MATMUL_MID_M_SPLIT_K_TILES if mid else ()
        fp32 = tuple(t for t in MATMUL_FP32_TILES if mid or t[5] == 1) if dtype == torch.float32 else ()
        return _with_split(MATMUL_LARGE_M_TILES + split + fp32), set()
    reduce = MATMUL_REDUCE_TILES if reduce_tiles_apply(precision, dtype) else ()
    tall = precision == "ieee" and dtype in (torch.float32, torch.float64) and bucket >= EXACT_TALL_M_BUCKET
    dot_tiles = MATMUL_DECODE_TILES + MATMUL_SPLIT_K_TILES + (MATMUL_EXACT_SPLIT_K_TILES if tall else ())
    return _with_split(dot_tiles), _with_split(reduce)


def matmul_min_block_m(bucket: int, precision: str, dtype: torch.dtype) -> int:
    """The fewest rows a tile that tuning may try for an M bucket has: what sizes a buffer
    with one row per tile row (the backward epilogue's column sums) before the tuner chooses."""
    dot_tiles, reduce_tiles = _candidate_tiles(bucket, precision, dtype)
    return min(t[0] for t in dot_tiles | reduce_tiles)


def split_k_fits(split: int, m: int, n: int, acc_bytes: int) -> bool:
    """Whether ``split`` ways of K keep the workspace within ``SPLIT_K_WORKSPACE_BYTES``."""
    return split == 1 or split * m * n * acc_bytes <= SPLIT_K_WORKSPACE_BYTES


def matmul_split_k_max(bucket: int, precision: str, dtype: torch.dtype, m: int, n: int, acc_bytes: int) -> int:
    """The widest split among the configs tuning may try for these sizes (1: none), which
    sizes the workspace a tuning launch passes."""
    dot_tiles, reduce_tiles = _candidate_tiles(bucket, precision, dtype)
    return max(t[5] for t in dot_tiles | reduce_tiles if split_k_fits(t[5], m, n, acc_bytes))


def prune_matmul_configs(configs, named_args, INPUT_PRECISION="ieee", **kwargs):
    """Autotune pre-filter: for small M the decode-sized tiles, plus, when the operands are
    fp32 / fp64 without TF32, the multiply-and-sum tiles (``reduce_tiles_apply``) and, for IEEE
    ones from ``EXACT_TALL_M_BUCKET`` rows, the tall split FMA tiles; the large-M tiles otherwise;
    split-K tiles with each set where the launch passes a workspace and it fits."""
    a = named_args["a_ptr"]
    dot_tiles, reduce_tiles = _candidate_tiles(named_args["M_BUCKET"], INPUT_PRECISION, a.dtype)
    acc_bytes = 8 if a.dtype == torch.float64 else 4
    m, n = named_args.get("M", 1), named_args.get("N", 1)
    # A launch without a workspace passes the output in its place.
    has_ws = named_args.get("ws_ptr") is not None and named_args.get("ws_ptr") is not named_args.get("c_ptr")
    kept = [
        c
        for c in configs
        if tile_of(c) in (dot_tiles if c.kwargs["DOT"] else reduce_tiles)
        and (c.kwargs["SPLIT_K"] == 1 or has_ws and split_k_fits(c.kwargs["SPLIT_K"], m, n, acc_bytes))
    ]
    return kept or configs


#: A tile that fits shared memory for every dtype, fp64 included: the config used
#: when autotuning is off (``fusedkit.settings``' ``autotune=False``), e.g. for deterministic
#: runs and for test suites that would otherwise tune hundreds of variants.
MATMUL_FIXED_TILE = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=MATMUL_GROUP_M, DOT=True, SPLIT_K=1)
MATMUL_FIXED_STAGES, MATMUL_FIXED_WARPS = 2, 4


def matmul_m_bucket(m: int) -> int:
    """Tuning key for M: the next power of two, capped, so a new batch size rarely re-tunes."""
    return min(MATMUL_MAX_M_BUCKET, 1 << max(0, (m - 1).bit_length()))


# --- Eager fast path (fusedkit._launch) ---------------------------------------------

#: Compiled kernels kept per launch site for direct launches; a cache that fills up
#: is cleared (each entry is a few hundred bytes; the binaries stay in Triton's cache).
COMPILED_CACHE_SIZE = 1024

#: Validated call signatures (kernel, dtypes, shapes, strides, devices) whose
#: launch is prepared; the same size bound and clearing rule.
CALL_CACHE_SIZE = 4096

#: Encoded TMA descriptors (128 bytes each) kept by address, shape, strides and layout;
#: a training loop repeats a handful (weights, and activations the caching allocator
#: returns at the same address). The same clearing rule.
TENSOR_MAP_CACHE_SIZE = 512


# --- Matmul: the TMA persistent kernel (fusedkit._matmul_tma) -------------------------

# Which matmul kernel runs where both could (``fusedkit.settings``' ``matmul_kernel``):
# "pointer" (the tiled kernel with per-thread loads), "tma" (persistent, tensor-descriptor
# loads; Hopper, aligned operands) or "auto", which chooses by these measurements.
#: "auto" takes the TMA kernel from this many rows of ``a`` up: at M = 512, N = K = 4096,
#: bf16, b row-major, autotuned, it leads the pointer kernel by 2% (H200, torch 2.11, triton
#: 3.6; this choice and the ones below with their figures: docs/design.md, "Matmul kernel
#: choice and tuning"), and leads for fp16 and for fp32 in nn.Linear's layout too;
#: at M = 128 and 256 the pointer kernel leads. fp32 with ``FUSEDKIT_FP32_MATMUL=ieee`` at
#: M = 512-1023 is untimed on either kernel.
MATMUL_TMA_MIN_M = 512
#: ... and, for 2-byte operands, in this M bucket (33-64 rows: one 64-row tile, where the TMA
#: kernel's 64 x 32 x 128 tile 8 stages deep streams the weight): at M = 64 bf16, the same
#: setup, 7% ahead (a small margin, docs/design.md says how small). At M = 16 and 32 the
#: pointer kernel's split-K tiles lead or tie, so those buckets stay with the pointer kernel.
MATMUL_TMA_HALF_M_BUCKET = 64
#: The same for float32 on TF32 tensor cores with row-major ``a`` and ``b``, which the TMA
#: kernel computes as a transposed product (``_matmul_tma.transposed_product``) and the
#: pointer kernel cannot: K = N = 4096, b row-major, autotuned, on the H200, TMA runs 1.5x as
#: fast as the pointer kernel at M = 128 with TF32, and leads with tf32x3 too.
MATMUL_TMA_MIN_M_TRANSPOSED = 128


def matmul_kernel_choice(m: int, transposed: bool = False, half: bool = False) -> str:
    """The kernel for ``m`` rows, "pointer" or "tma" (the TMA kernel still needs eligible
    operands); ``transposed``: the TMA kernel would run the transposed product; ``half``:
    2-byte operands."""
    choice = settings.current().matmul_kernel
    if choice == "auto":
        if transposed:
            return "tma" if m >= MATMUL_TMA_MIN_M_TRANSPOSED else "pointer"
        small = half and matmul_m_bucket(m) == MATMUL_TMA_HALF_M_BUCKET
        return "tma" if m >= MATMUL_TMA_MIN_M or small else "pointer"
    return choice


#: float32 on TF32 tensor cores with row-major ``a`` and ``b``: from this many rows of ``a``
#: "auto" copies ``b`` into a K-major buffer (``_matmul.kmajor_copy``: K x N x 4 bytes read
#: and as many written, each call, through a kept launch) and runs ``a @ b`` on that, instead
#: of the transposed product, whose ``b^T`` goes through registers. The copy pays only with
#: the TMA kernel after it, so this is at least ``MATMUL_TMA_MIN_M`` (a test holds it there).
#: On the H200 (K = N = 4096) the copy and ``a @ b`` lead the transposed product by 18% at
#: M = 512, and lead at larger M too; at M = 256, where ``a @ b`` runs on the pointer kernel,
#: the transposed product leads.
MATMUL_TF32_COPY_MIN_M = 512


def tf32_copies_b(m: int) -> bool:
    """Whether a TF32 matmul with row-major ``a`` and ``b`` and ``m`` rows copies ``b``
    K-major first (``MATMUL_TF32_COPY_MIN_M``; only when the kernel is chosen by "auto")."""
    return settings.current().matmul_kernel == "auto" and m >= MATMUL_TF32_COPY_MIN_M


#: TMA tiles tuned for fp32 operands only, (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, SUBTILE).
#: 64 x 64 gives 128 tiles at M = 128, N = 4096, where the smallest tile otherwise offered to
#: fp32 (64 x 128) leaves 68 of the H200's 132 SMs idle: with it alone (K = 4096, b row-major)
#: tf32x3 runs at M = 128 half as fast as at M = 256, twice the tiles. The tile
#: must keep 64 rows on ``wgmma``'s M side in either product (``a @ b`` and the transposed
#: one), which 64 x 64 does (checked on sm_90 by tests/test_codegen.py).
#: The deeper 32-wide K steps after it are for TF32 on a K-major ``b`` (the copy above), where
#: cuBLAS runs 128 x 128 x 32 (M = 512: ``sm90_xmma_..._tilesize128x128x32``): that tile at 5
#: stages, a 128 x 256 one for large M and a 64 x 256 one (128 tiles at M = 512, N = 4096),
#: each as deep as shared memory allows. Compiled for sm_90 by Triton 3.6
#: (``_codegen.compile_matmul_tma``, on the CPU) they take 161-224 KiB in both products and
#: both fp32 modes (the most: 128 x 256 x 32, tf32x3, K-major ``b``; 6 stages of 128 x 128 x 32
#: would take 240 KiB in the transposed TF32 product, over the 227 available). With them
#: ``a @ b`` with TF32 on a K-major ``b`` runs 26% faster at M = 1024 than without (H200).
TMA_FP32_TILES = (
    (64, 64, 32, 5, 4, False),
    (128, 128, 32, 5, 8, True),
    (128, 256, 32, 3, 8, True),
    (64, 256, 32, 4, 4, True),
)


def matmul_tma_configs(pre_hook=None):
    """Autotune candidates of the TMA kernel on Hopper: mostly 128-row tiles with 64-wide K
    steps (128 bytes of bf16: one TMA swizzle span), 3-6 stages; SUBTILE halves the
    epilogue's shared memory so a deeper pipeline fits."""
    from triton import Config

    def cfg(bm, bn, bk, stages, warps, subtile):
        return Config(
            dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=MATMUL_GROUP_M, SUBTILE=subtile),
            num_stages=stages,
            num_warps=warps,
            pre_hook=pre_hook,
        )

    return [
        cfg(128, 256, 64, 3, 8, True),
        cfg(128, 256, 64, 4, 8, True),
        cfg(128, 128, 64, 4, 8, False),
        cfg(128, 128, 64, 4, 4, True),
        cfg(128, 256, 64, 3, 8, False),
        cfg(64, 128, 64, 4, 4, False),
        cfg(64, 256, 64, 4, 4, True),
        cfg(128, 64, 64, 4, 4, False),
        # Deeper pipelines, each the fastest of its shape (H200, bf16, N = K = 4096, b
        # row-major, CUDA-graph replays): at M = 512 128 x 128 x 64 at 6 stages takes 8% less
        # time than at 4 stages; at M = 64 64 x 32 x 128 at 8 stages leads the 64-row tiles.
        cfg(128, 128, 64, 5, 8, True),
        cfg(128, 128, 64, 6, 8, True),
        cfg(64, 256, 64, 5, 4, True),
        cfg(64, 32, 128, 8, 4, False),
        # 32-wide K steps: 128 bytes of fp32, so fp32 (TF32) operands fit too
        cfg(128, 128, 32, 3, 8, True),
        cfg(64, 128, 32, 4, 4, False),
        *(cfg(*tile) for tile in TMA_FP32_TILES),
    ]


#: Shared memory of one block on Hopper (sm_90: 227 KiB).
HOPPER_SMEM_BYTES = 232448


def tma_stage_bytes(config, element_size: int, gated: bool = False) -> int:
    """Shared memory of a TMA config's operand pipeline: ``num_stages`` tiles of ``a`` and ``b``
    (and of ``b2``, ``gated``)."""
    k = config.kwargs
    b_tiles = 2 if gated else 1
    return config.num_stages * (k["BLOCK_M"] + b_tiles * k["BLOCK_N"]) * k["BLOCK_K"] * element_size


def tma_tile_of(config) -> tuple:
    k = config.kwargs
    return k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], config.num_stages, config.num_warps, k["SUBTILE"]


def prune_tma_configs(configs, named_args, GATED=False, **kwargs):
    """Autotune pre-filter: drop the TMA configs whose operand pipeline alone overflows
    Hopper's shared memory at this operand size (the deep bf16 tiles with fp32 operands, the
    wide ones with the gated epilogue's second B tile), which would otherwise each be compiled
    only to fail, and fp32's own tiles (``TMA_FP32_TILES``) for narrower operands."""
    size = named_args["a_desc"].base.element_size()
    return [
        c
        for c in configs
        if tma_stage_bytes(c, size, GATED) <= HOPPER_SMEM_BYTES and (size >= 4 or tma_tile_of(c) not in TMA_FP32_TILES)
    ] or configs


#: K step of the fixed TMA config, in bytes: one 128-byte swizzle span per row.
TMA_K_BYTES = 128


def matmul_tma_fixed_tile(element_size: int, gated: bool = False) -> dict:
    """Fixed config of the TMA kernel (FUSEDKIT_AUTOTUNE=0) for operands of ``element_size`` bytes
    (``gated``: a second B tile in the pipeline and three output tiles, stored in halves)."""
    return dict(
        BLOCK_M=128,
        BLOCK_N=128,
        BLOCK_K=TMA_K_BYTES // element_size,
        GROUP_M=MATMUL_GROUP_M,
        SUBTILE=element_size > 2 or gated,
    )


MATMUL_TMA_FIXED_OPTIONS = dict(num_warps=8, num_stages=3)
MATMUL_TMA_INTERPRETER_TILE = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, SUBTILE=True)
