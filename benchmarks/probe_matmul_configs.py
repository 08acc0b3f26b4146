"""Every matmul config tuning may try for one shape, timed directly (GPU), beside the
time the autotuner measured for it and the config it picked.

    python benchmarks/probe_matmul_configs.py [dtype M N K] ...   (default: the three cases below)

At commit f9196c6 on the H200 (torch 2.11, triton 3.6), with split-K tiles added, tuning
picked a split-K tile for bf16 M = 64, N = K = 4096 that then ran 37.5 us, against 22.8 us
for the tile it picked without split-K (fp16, same tiles: 102.5 TFLOP/s, bf16 68.8): this
tells whether the autotuner's timings and the kernels' own times disagree.
"""

from __future__ import annotations

import sys

import torch
import triton

import fusedkit
from fusedkit import _matmul as mm
from fusedkit.bench import _timer
from fusedkit.configs import SMALL_M_BUCKET, SPLIT_K_MAX_M_BUCKET, _config, _tile_of, matmul_configs, prune_matmul_configs, settings

CASES = (("bf16", 64, 4096, 4096), ("fp16", 64, 4096, 4096), ("fp32", 64, 4096, 4096), ("fp32x3", 64, 4096, 4096),
         ("bf16", 512, 4096, 4096), ("fp32x3", 512, 4096, 4096))
#: fp32x3: float32 with FUSEDKIT_FP32_MATMUL=tf32x3 (every case runs with TF32 off).
#: Tiles tuning does not offer, timed beside them for half types at M <= 64, as (BLOCK_M,
#: BLOCK_N, BLOCK_K, stages, warps, SPLIT_K): deeper pipelines, wider K steps, more splits.
#: At M = 64, N = K = 4096 bf16 the three best offered tiles lay within 0.8 us (20.9-21.7)
#: against cuBLASLt's 17.9 (c93e6d2): the weight (32 MiB) streamed at 1.6 TB/s, a third of
#: the H200's; the question is whether any tile of this kernel streams it faster.
EXTRA_SMALL_M_TILES = (
    (64, 64, 128, 4, 4, 4), (64, 64, 64, 6, 4, 4), (64, 64, 64, 4, 4, 8), (64, 64, 128, 3, 4, 8),
    (64, 128, 64, 4, 4, 8), (64, 32, 128, 4, 4, 4), (64, 32, 64, 6, 2, 4),
    (64, 64, 256, 2, 4, 4), (64, 128, 64, 5, 8, 4), (64, 64, 64, 4, 4, 16), (64, 128, 64, 4, 4, 16),
)
#: The same for M buckets up to SPLIT_K_MAX_M_BUCKET: M = 512, N = K = 4096 bf16 took 32.6 us
#: against cuBLASLt's 28.4 (0ede8f0) with 128 x 128 tiles, 128 programs for 132 SMs.
EXTRA_MID_M_TILES = (
    (128, 64, 64, 4, 4, 1), (128, 64, 64, 5, 4, 1), (128, 64, 128, 3, 4, 1), (64, 128, 64, 5, 4, 1),
    (128, 128, 128, 3, 8, 1), (256, 64, 64, 3, 8, 1), (128, 64, 64, 4, 4, 2), (64, 128, 128, 3, 4, 2),
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp32x3": torch.float32}


def probe(dtype, m, n, k, dev):
    a, w, bias = (torch.randn(*s, device=dev, dtype=dtype) for s in ((m, k), (n, k), (n,)))
    b = w.t()
    out = torch.empty(m, n, device=dev, dtype=dtype)
    plan = mm.plan_matmul(a, b, bias, "relu", out)
    half = a.element_size() == 2
    extra = [_config(t) for t in (EXTRA_SMALL_M_TILES if m <= SMALL_M_BUCKET else EXTRA_MID_M_TILES if
                                  m <= SPLIT_K_MAX_M_BUCKET else ()) if half]
    split = max([plan.split_k] + [c.kwargs["SPLIT_K"] for c in extra])
    buffers = mm.split_k_buffers(a.device, split, m, n, plan.ws_dtype) if split > 1 else None
    args, meta = mm.launch_config(a, b, bias, "relu", out, None, buffers)
    named = dict(zip(mm._matmul_kernel.arg_names, args))
    configs = prune_matmul_configs(matmul_configs(), named, INPUT_PRECISION=meta["INPUT_PRECISION"]) + extra
    fusedkit.linear_relu(a, w, bias)  # tunes
    tuned = mm._matmul_tuned
    best = getattr(tuned, "best_config", None)  # (set only where tuning ran: a GPU)
    picked = _tile_of(best) if best is not None else None
    at = {_tile_of(c): t for c, t in (getattr(tuned, "configs_timings", None) or {}).items()}
    us = _timer(dev)
    flop = 2 * m * n * k
    print(f"{dtype} M={m} N={n} K={k} ({meta['INPUT_PRECISION']}): tile, our do_bench us, TFLOP/s, autotuner's us")
    rows = []
    for cfg in configs:
        tile = cfg.kwargs
        grid = (triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"]), tile["SPLIT_K"])

        def run(tile=tile, grid=grid, cfg=cfg):
            options = {} if mm.INTERPRETED else dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            mm._matmul_kernel[grid](*args, **meta, **tile, EVEN_K=k % tile["BLOCK_K"] == 0, **options)
        try:
            run()
            t = us(run)
        except Exception as e:  # a config that does not fit (the autotuner skips those too)
            print(f"  {_tile_of(cfg)}: {type(e).__name__}")
            continue
        mine = at.get(_tile_of(cfg))
        rows.append((t, _tile_of(cfg), mine))
    for t, tile, mine in sorted(rows):
        mark = "  <- picked" if tile == picked else "  (extra)" if tile in EXTRA_SMALL_M_TILES + EXTRA_MID_M_TILES else ""
        tuned_us = f"{1e3 * mine[0]:8.1f}" if mine else "       -"
        print(f"  {str(tile):<32} {t:8.1f} {flop / t / 1e6:7.1f} {tuned_us}{mark}")
    got = fusedkit.linear_relu(a, w, bias)
    ref = torch.relu(torch.nn.functional.linear(a.double(), w.double(), bias.double()))
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    print(f"  linear_relu as called: {us(lambda: fusedkit.linear_relu(a, w, bias)):.1f} us (max error / max |ref| "
          f"{err:.2e}); torch relu(F.linear): {us(lambda: torch.relu(torch.nn.functional.linear(a, w, bias))):.1f} us")


def main():
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a CPU run only checks the script
    argv = sys.argv[1:]
    cases = [(argv[i], *map(int, argv[i + 1:i + 4])) for i in range(0, len(argv), 4)] if argv else CASES
    for name, m, n, k in cases:
        allow = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            with settings(FUSEDKIT_FP32_MATMUL="tf32x3" if name == "fp32x3" else "ieee"):
                probe(DTYPES[name], m, n, k, dev)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allow


if __name__ == "__main__":
    main()
