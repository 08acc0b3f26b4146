"""Small-M bf16 ``matmul_relu``: is the time the GPU's or the host's? (H200 question, 2026-12-03.)

At 6b564a5 bf16 ``matmul_relu`` with bias, M = 64, K = N = 4096, took 21.0 us (do_bench)
against cuBLASLt's 17.9; at b758956 the same tile took 39.3 against 20.4. do_bench queues
calls back to back, so a call whose host work outlasts its kernel is timed by the host.
For each M this prints three times per call: do_bench's median, the host's time to enqueue
one call (no sync inside the loop), and a CUDA graph of the call replayed (GPU time alone,
no Python). Then the fp32 cases the b758956 probe ran before it, then bf16 again.

``forced``: the matmul report's three fusedkit columns in its order (``auto``, then each
kernel forced) at M = 64 and 512, bf16 and fp16, with the same three times. The report's
forced-TMA column ran about half of ``auto``'s speed in some rows though the two share one
kept launch (99b4b22: bf16 M = 512 361.5 against 568.1 TFLOP/s, fp16 M = 64 64.1 against
115.7; 7e41c73: bf16 M = 64 36.0 against 19.3 us).

    python benchmarks/probe_small_m.py [M ...]     (default: 1 16 64 512)
    python benchmarks/probe_small_m.py forced
    python benchmarks/probe_small_m.py profile M ...
"""

from __future__ import annotations

import sys

import torch
from probe_linear_backward import host_us  # this folder is on the path when the script runs

import fusedkit
from fusedkit.bench import _timer

K = N = 4096
#: Calls per host-time measurement (enough to fill the launch queue's steady state).
HOST_CALLS = 200


def _graph_us(fn, timer) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (tuning, split-K buffers) on the capturing stream
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return timer(graph.replay)


def rows(ms, timer, label):
    print(f"bf16 matmul_relu with bias, K = N = {K} ({label}): do_bench us / host us per call / graph replay us")
    for m in ms:
        a, b, bias = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((m, K), (K, N), (N,)))
        peers = (("fusedkit.matmul_relu", lambda: fusedkit.matmul_relu(a, b, bias)),
                 ("torch._addmm_activation", lambda: torch._addmm_activation(bias, a, b)),
                 ("torch.relu(addmm)", lambda: torch.relu(torch.addmm(bias, a, b))))
        for name, fn in peers:
            fn()
            print(f"  M={m:<5} {name:<26} {timer(fn):8.1f} {host_us(fn, HOST_CALLS)[0]:8.1f} {_graph_us(fn, timer):8.1f}")


def forced_rows(timer, ms=(64, 512)):
    from fusedkit.configs import settings

    print(f"matmul_relu with bias, K = N = {K}, the report's columns: do_bench us / host us per call / graph replay us")
    for dtype in (torch.bfloat16, torch.float16):
        for m in ms:
            a, b, bias = (torch.randn(*s, device="cuda", dtype=dtype) for s in ((m, K), (K, N), (N,)))

            def fn():
                return fusedkit.matmul_relu(a, b, bias)
            for kernel in ("auto", "pointer", "tma", "auto"):
                with settings(FUSEDKIT_MATMUL_KERNEL=kernel):
                    t = timer(fn)
                    print(f"  {str(dtype):<15} M={m:<4} {kernel:<8} {t:8.1f} {host_us(fn, HOST_CALLS)[0]:8.1f} "
                          f"{_graph_us(fn, timer):8.1f}  do_bench again {timer(fn):8.1f}", flush=True)


def profile(m, calls: int = HOST_CALLS, top: int = 14):
    """Where a repeated call's host time goes (cProfile, inclusive of its own overhead):
    M = 64 took 30.5 us of host time a call against 20.2 at M = 1 (0ede8f0)."""
    import cProfile
    import pstats

    a, b, bias = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((m, K), (K, N), (N,)))
    fusedkit.matmul_relu(a, b, bias)
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [fusedkit.matmul_relu(a, b, bias) for _ in range(calls)])
    torch.cuda.synchronize()
    print(f"M={m}: host profile of {calls} calls, by own time")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main():
    if not torch.cuda.is_available():
        print("needs a GPU (host and graph times)")
        return
    timer = _timer(torch.device("cuda"))
    if sys.argv[1:] == ["forced"]:
        forced_rows(timer)
        return
    if sys.argv[1:2] == ["profile"]:  # profile M ...: where a repeated call's host time goes
        for m in [int(v) for v in sys.argv[2:]] or [16, 64]:
            profile(m, top=24)
        return
    ms = [int(v) for v in sys.argv[1:]] or [1, 16, 64, 512]
    rows(ms, timer, "fresh process")
    for m in (16, 64):
        profile(m)
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    for m in (64, 512, 4096):  # the fp32 cases b758956's probe ran before its bf16 rows
        a, w = torch.randn(m, K, device="cuda"), torch.randn(N, K, device="cuda")
        fusedkit.linear_relu(a, w, torch.randn(N, device="cuda"))
    torch.backends.cuda.matmul.allow_tf32 = allow
    rows(ms, timer, "after fp32 linear_relu at M = 64, 512, 4096")


if __name__ == "__main__":
    main()
