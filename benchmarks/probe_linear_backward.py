"""Where LinearReLU's forward + backward time goes (GPU): each matmul of the training
step timed alone against torch's, and which tile the autotuner picked.

    python benchmarks/probe_linear_backward.py [M K N]

At commit e375e1b on the H200 (torch 2.11, triton 3.6) fwd + bwd at 4096^3 bf16 took
1001.7 us against torch's 630.3 (0.63x), unchanged by taking the eager calls off the
dispatcher: so not host time. This times the pieces: the forward, the activation's
gradient, grad_a = g @ W (W row-major), grad_b = x.t() @ g (a column-major ``a``, the TMA
kernel's A_MMAJOR path), the bias gradient, and torch's matmuls for the same products.
It also prints the tile chosen for fp32 ``linear_relu`` at M = 64, K = N = 4096 with TF32
off (302 us against cuBLAS's 90 us in the same run).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
import triton

import fusedkit
from fusedkit import _matmul as mm
from fusedkit import _matmul_tma as tma


def _us(fn) -> float:
    if torch.cuda.is_available():
        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    t0 = time.perf_counter()  # a CPU dry run (TRITON_INTERPRET=1): checks the script, times nothing useful
    fn()
    return 1e6 * (time.perf_counter() - t0)


def _best(autotuner) -> str:
    cfg = getattr(autotuner, "best_config", None)
    return "none (not autotuned yet)" if cfg is None else str(cfg)


def main():
    m, k, n = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (4096, 4096, 4096)
    dev, dt = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    lin = torch.nn.Linear(k, n, device=dev, dtype=dt)
    w, bias = lin.weight.detach(), lin.bias.detach()
    out = fusedkit.linear_relu(x, w, bias)
    g_out = torch.randn_like(out)
    g = torch.where(out > 0, g_out, 0)
    rows = [
        ("forward: linear_relu(x, W, b)", lambda: fusedkit.linear_relu(x, w, bias)),
        ("  torch: relu(F.linear(x, W, b))", lambda: torch.relu(F.linear(x, w, bias))),
        ("activation grad: where(out > 0, g, 0)", lambda: fusedkit.elementwise("relu_grad", g_out, out)),
        ("grad_a = matmul(g, W)", lambda: fusedkit.matmul(g, w)),
        ("  torch.mm(g, W)", lambda: torch.mm(g, w)),
        ("grad_b = matmul(x.t(), g)  [column-major a]", lambda: fusedkit.matmul(x.t(), g)),
        ("  torch.mm(x.t(), g)", lambda: torch.mm(x.t(), g)),
        ("  torch.mm(g.t(), x)  [nn.Linear's own order]", lambda: torch.mm(g.t(), x)),
        ("grad_bias = g.sum(0) in fp32", lambda: g.sum(0, dtype=torch.float32).to(dt)),
    ]
    print(f"M={m} K={k} N={n} bf16, do_bench medians, us")
    for label, fn in rows:
        fn()
        print(f"{label:<48} {_us(fn):9.1f}")
    print("TMA kernel for x.t() @ g:", tma.layout_ok(x.t(), g, torch.empty(k, n, device=dev, dtype=dt), None, dev.type != "cuda"),
          "| a column-major:", tma.a_mmajor(x.t()))
    print("pointer kernel's last tuned config:", _best(mm._matmul_tuned))
    print("TMA kernel's last tuned config:", _best(tma._matmul_tma_tuned))
    module, ref = fusedkit.nn.LinearReLU(k, n, device=dev, dtype=dt), torch.nn.Sequential(lin, torch.nn.ReLU())
    module.load_state_dict(lin.state_dict())
    xg = x.clone().requires_grad_()
    for label, mod in (("fwd+bwd LinearReLU", module), ("  torch Linear+ReLU", ref)):
        params = [xg, *mod.parameters()]
        print(f"{label:<48} {_us(lambda: torch.autograd.grad(mod(xg), params, g_out)):9.1f}")

    if dev.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    a32, w32, b32 = torch.randn(64, 4096, device=dev), torch.randn(4096, 4096, device=dev), torch.randn(4096, device=dev)
    print(f"fp32 (TF32 off) linear_relu M=64 K=N=4096: {_us(lambda: fusedkit.linear_relu(a32, w32, b32)):.1f} us; "
          f"torch {_us(lambda: torch.relu(F.linear(a32, w32, b32))):.1f} us")
    print("  its tuned config:", _best(mm._matmul_tuned))


if __name__ == "__main__":
    main()
