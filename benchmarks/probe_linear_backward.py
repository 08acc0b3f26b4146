"""Where LinearReLU's forward + backward time goes (GPU): each matmul of the training
step timed alone against torch's, and which tile the autotuner picked.

    python benchmarks/probe_linear_backward.py [M K N]

At commit e375e1b on the H200 (torch 2.11, triton 3.6) fwd + bwd at 4096^3 bf16 took
1001.7 us against torch's 630.3 (0.63x), unchanged by taking the eager calls off the
dispatcher: so not host time. This times the pieces: the forward, the activation's
gradient, grad_a = g @ W (W row-major), grad_b = x.t() @ g (a column-major ``a``, the TMA
kernel's A_MMAJOR path), the bias gradient, and torch's matmuls for the same products.
It also prints the tile chosen for fp32 ``linear_relu`` at M = 64, 512 and 4096, K = N = 4096
with TF32 off (302 us against cuBLAS's 90 us at M = 64 in one run), and times the same
call with ``FUSEDKIT_FP32_MATMUL=tf32x3``, with each result's error against float64.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import fusedkit
from fusedkit import _matmul as mm
from fusedkit import _matmul_tma as tma
from fusedkit.bench import _timer  # the report's timer: do_bench medians on a GPU (a CPU run only checks the script)
from fusedkit.configs import settings


def _best(autotuner) -> str:
    cfg = getattr(autotuner, "best_config", None)
    return "none (not autotuned yet)" if cfg is None else str(cfg)


def main():
    m, k, n = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (4096, 4096, 4096)
    dev, dt = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    us = _timer(dev)
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
        ("grad_bias = g.sum(0)", lambda: g.sum(0)),
    ]
    print(f"M={m} K={k} N={n} bf16, do_bench medians, us")
    for label, fn in rows:
        fn()
        print(f"{label:<48} {us(fn):9.1f}")
    print("TMA kernel for x.t() @ g:", tma.layout_ok(x.t(), g, torch.empty(k, n, device=dev, dtype=dt), None, dev.type != "cuda"),
          "| a column-major:", tma.a_mmajor(x.t()))
    print("pointer kernel's last tuned config:", _best(mm._matmul_tuned))
    print("TMA kernel's last tuned config:", _best(tma._matmul_tma_tuned))
    module, ref = fusedkit.nn.LinearReLU(k, n, device=dev, dtype=dt), torch.nn.Sequential(lin, torch.nn.ReLU())
    module.load_state_dict(lin.state_dict())
    xg = x.clone().requires_grad_()
    for label, mod in (("fwd+bwd LinearReLU", module), ("  torch Linear+ReLU", ref)):
        params = [xg, *mod.parameters()]
        print(f"{label:<48} {us(lambda: torch.autograd.grad(mod(xg), params, g_out)):9.1f}")
    if dev.type == "cuda":  # the pieces above sum to less than the step (e375e1b): kernels or gaps?
        for label, mod in (("fusedkit LinearReLU", module), ("torch Linear+ReLU", ref)):
            step = lambda mod=mod: torch.autograd.grad(mod(xg), [xg, *mod.parameters()], g_out)  # noqa: E731
            _host_time(label, step)
            _profile(label, step)
            _syncs(label, step)
            # Forward and backward apart: which half holds the host?
            params = [xg, *mod.parameters()]
            _host_time(f"{label} forward alone (recording autograd)", lambda mod=mod: mod(xg))
            y = mod(xg)
            _host_time(f"{label} backward alone", lambda y=y, p=params: torch.autograd.grad(y, p, g_out, retain_graph=True))
        step = lambda: torch.autograd.grad(module(xg), [xg, *module.parameters()], g_out)  # noqa: E731
        _host_split(step)
        _host_alone(x, w, bias, g_out, out)
        # The same step on other launch paths: is the host time the TMA kernel's launches?
        for env in ({"FUSEDKIT_AUTOTUNE": "0"}, {"FUSEDKIT_AUTOTUNE": "0", "FUSEDKIT_MATMUL_KERNEL": "pointer"}):
            with settings(**env):
                _host_time(f"fusedkit LinearReLU, {' '.join(f'{k}={v}' for k, v in env.items())}", step)

    for rows in ((64, 512, 4096) if dev.type == "cuda" else (m,)):
        _exact_fp32(dev, rows, *((4096, 4096) if dev.type == "cuda" else (k, n)), ieee=rows < 4096)
    for rows in ((64, 512) if dev.type == "cuda" else (m,)):
        _decode(dev, rows, *((4096, 4096) if dev.type == "cuda" else (k, n)))


def _decode(dev, m, k, n):
    """bf16 ``matmul_relu`` with bias at small M (0.74x cuBLASLt's epilogue at M = 64 and 0.89x
    at M = 512, N = K = 4096, 87e937c): the time beside cuBLASLt's and the tile tuning picked."""
    a, b, bias = (torch.randn(*s, device=dev, dtype=torch.bfloat16) for s in ((m, k), (k, n), (n,)))
    print(f"bf16 matmul_relu M={m} K={k} N={n}, us:")
    fusedkit.matmul_relu(a, b, bias)
    print("  tuned config:", _best(mm._matmul_tuned))
    for label, fn in (("fusedkit.matmul_relu", lambda: fusedkit.matmul_relu(a, b, bias)),
                      ("torch._addmm_activation", lambda: torch._addmm_activation(bias, a, b)),
                      ("torch.mm", lambda: torch.mm(a, b))):
        print(f"  {label:<30} {_timer(dev)(fn):9.1f}")


def host_us(step, steps: int = 20) -> tuple[float, float]:
    """(host us to enqueue a step, wall us a step) over ``steps`` steps without a sync
    inside: equal means the GPU waits on the host."""
    import time

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / steps, 1e6 * (t2 - t0) / steps


def _host_time(label, step, steps: int = 20, unit: str = "step"):
    host, wall = host_us(step, steps)
    print(f"{label}: host {host:.1f} us to enqueue a {unit}, {wall:.1f} us wall")


def _syncs(label, step) -> None:
    """Any call in a step that torch's sync debug mode flags (a host-device synchronisation)."""
    import warnings

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    # Setting the mode warns once that it is a prototype: that warning is no synchronisation.
    caught = [w for w in caught if "prototype" not in str(w.message)]
    print(f"{label}: {len(caught)} synchronising call(s) flagged" + (f", first: {caught[0].message}" if caught else ""))


def _host_split(step, steps: int = 20) -> None:
    """Host time of each piece of a fusedkit LinearReLU step (inclusive; no sync inside the
    step), to find the call that holds the host: e18660b measured 844 us a step of host time
    against torch's 558 with the same kernel time."""
    import collections
    import time

    from fusedkit import _launch

    totals, counts, patched = collections.defaultdict(float), collections.Counter(), []

    def wrap(owner, name):
        fn = owner.__dict__[name]
        inner = fn.__func__ if isinstance(fn, staticmethod) else fn
        label = f"{getattr(owner, '__name__', owner).split('.')[-1]}.{name}"

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - t0
                counts[label] += 1
        setattr(owner, name, staticmethod(timed) if isinstance(fn, staticmethod) else timed)
        patched.append((owner, name, fn))

    for owner, name in ((mm, "matmul"), (mm, "_validate"), (mm, "_apply"), (mm, "_forward"), (mm, "_backward"),
                        (mm, "_activation_grad"), (mm, "launch_matmul"), (mm, "_launch_tma"),
                        (mm, "plan_matmul"), (tma, "descriptors"), (tma, "tail_args"),
                        (_launch.CompiledCache, "run")):
        if name in owner.__dict__:
            wrap(owner, name)
    try:
        step()
        torch.cuda.synchronize()
        totals.clear()
        counts.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        for owner, name, fn in patched:
            setattr(owner, name, fn)
    print(f"fusedkit LinearReLU host time by piece (inclusive, us a step; {1e6 * host / steps:.1f} us a step in all):")
    for label, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {1e6 * total / steps:9.1f} us  x{counts[label] // steps}  {label}")


def _host_alone(x, w, bias, g, out, calls: int = 50) -> None:
    """The step's host pieces called alone, back to back without autograd (host time per call
    while enqueuing, and wall time after a synchronize). At c93e6d2 the same pieces took 24 us
    (four TMA descriptors; 13.5 us alone on a 2-core CPU host) and 82 us (a TMA
    ``launch_matmul``) per call inside a training step: alone, are they slow too?"""
    import threading

    tile = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, SUBTILE=True)
    print(f"the step's pieces alone ({calls} calls each; then the same from another thread,")
    print("as autograd runs a CUDA backward: 6b564a5 measured 250 us for these alone against 839 a step):")
    for label, fn in (("four TMA descriptors", lambda: tma.descriptors(x, w.t(), out, None, tile)),
                      ("linear_relu(x, W, b), no autograd", lambda: fusedkit.linear_relu(x, w, bias)),
                      ("matmul(g, W), no autograd", lambda: fusedkit.matmul(g, w)),
                      ("matmul(x.t(), g), no autograd", lambda: fusedkit.matmul(x.t(), g)),
                      ("relu_grad(g, out)", lambda: fusedkit.elementwise("relu_grad", g, out))):
        _host_time(f"  {label}", fn, calls, unit="call")
        worker = threading.Thread(target=_host_time, args=(f"  {label}, another thread", fn, calls),
                                  kwargs={"unit": "call"})
        worker.start()
        worker.join()


def _profile(label, step, steps: int = 5):
    """Kernels of ``steps`` training steps by GPU time, beside the steps' wall time."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
    print(f"{label}: {start.elapsed_time(end) * 1e3 / steps:.1f} us a step (events, profiled); kernels:")
    events = [e for e in prof.key_averages() if getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) > 0
              and e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)))
    if not events:
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=10, max_name_column_width=60))
    for e in events[:8]:
        total = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))
        print(f"  {total / steps:9.1f} us  x{e.count // steps}  {e.key[:90]}")
    print(f"{label}: host calls by self CPU time (profiled, us a step):")
    cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for e in cpu[:10]:
        print(f"  {e.self_cpu_time_total / steps:9.1f} us  x{e.count // steps}  {e.key[:90]}")


def _exact_fp32(dev, m, k, n, ieee: bool = True):
    """fp32 ``linear_relu`` with TF32 off (302 us against cuBLAS's 90 at M = 64, K = N = 4096,
    e375e1b): the tuned tile, and the same call with ``FUSEDKIT_FP32_MATMUL=tf32x3`` (since
    this session fusedkit's own truncating split), with each result's error against float64.
    ``ieee=False`` leaves out the IEEE kernel (its tuning is slow at large M)."""
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a, w, bias = torch.randn(m, k, device=dev), torch.randn(n, k, device=dev), torch.randn(n, device=dev)
        ref = torch.relu(F.linear(a.double(), w.double(), bias.double()))
        print(f"fp32 (TF32 off) linear_relu M={m} K={k} N={n}, us:")
        rows = [("fusedkit (ieee)", "ieee"), ("fusedkit (tf32x3)", "tf32x3"), ("torch relu(F.linear)", None)]
        for label, mode in rows[0 if ieee else 1:]:
            with settings(FUSEDKIT_FP32_MATMUL=mode or "ieee"):
                fn = (lambda: fusedkit.linear_relu(a, w, bias)) if mode else (lambda: torch.relu(F.linear(a, w, bias)))
                got = fn()
                err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
                print(f"  {label:<30} {_timer(dev)(fn):9.1f}   max error / max |ref| {err:.2e}")
            if mode:
                kernel = tma._matmul_tma_tuned if mm.matmul_kernel_choice(m) == "tma" else mm._matmul_tuned
                print("    tuned config:", _best(kernel))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow


if __name__ == "__main__":
    main()
