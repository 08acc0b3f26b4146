"""Backward and memory report: ``python -m fusedkit bench --backward``.

For ``z = add_relu(x, y)`` with x, y requiring grad:
- backward time (``torch.autograd.grad`` of a retained graph, ``do_bench`` median)
  and GB/s over the bytes a backward must move (read the incoming gradient and
  the saved output, write one gradient: alpha = 1 gives y the same tensor), for
  fusedkit, eager ``torch.relu(x + y)`` and ``torch.compile`` of it;
- bytes saved for backward, counted with ``torch.autograd.graph.saved_tensors_hooks``
  (distinct storages), and the peak memory above the inputs of forward + backward
  (``torch.cuda.max_memory_allocated``), for the same three.
On a CPU the harness runs at small sizes; its times are not GPU times.
"""

from __future__ import annotations

import contextlib

import torch

import fusedkit

from .cases import timer
from .progress import bar as progress_bar

__all__ = ["keep_saved_buffers", "run_backward", "format_backward_table", "run_linear_training", "format_linear_table",
           "BACKWARD_SIZES", "LINEAR_TRAINING_SHAPES"]

BACKWARD_SIZES = (1 << 24, 1 << 28)
CPU_BACKWARD_SIZES = (1 << 10,)
#: (tokens M, in K, out N) of the LinearReLU training step: an MLP up-projection.
LINEAR_TRAINING_SHAPES = ((4096, 4096, 4096), (8192, 4096, 11008))
CPU_LINEAR_TRAINING_SHAPES = ((32, 48, 40),)


def _eager(x, y):
    return torch.relu(x + y)


def _saved_bytes(fn, x, y) -> int:
    """Bytes of the distinct storages autograd keeps for backward after ``fn(x, y)``."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        z = fn(x, y)
    # the output itself is allocated either way; count what is kept beyond the inputs
    for t in (x, y):
        seen.pop(t.untyped_storage().data_ptr(), None)
    del z
    return sum(seen.values())


def _peak_bytes(fn, x, y, g, device) -> int | None:
    """Peak allocation above the live inputs during one forward + backward."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    z = fn(x, y)
    gx, gy = torch.autograd.grad(z, (x, y), g)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del z, gx, gy
    return peak


def _time_us(fn, device) -> float:
    return timer(device)(fn)  # the report's timer: do_bench medians on a GPU


def keep_saved_buffers():
    """The timed loop re-runs one backward graph (``retain_graph=True``); AOT autograd refuses
    that for a compiled backward that was handed the forward's saved buffers to reuse
    ("donated buffers", on by default since torch 2.6), so the compiled peer is built without."""
    try:
        from torch._functorch import config
    except ImportError:  # pragma: no cover - a PyTorch without AOT autograd's config
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False) if hasattr(config, "donated_buffer") else contextlib.nullcontext()


def run_backward(dtypes, device, sizes=BACKWARD_SIZES, use_compile=True) -> list[dict]:
    impls = {"fusedkit": fusedkit.add_relu, "eager": _eager}
    if use_compile and device.type == "cuda":
        impls["compiled"] = torch.compile(_eager)
    with keep_saved_buffers():
        return _run_backward(impls, dtypes, device, sizes)


def _run_backward(impls, dtypes, device, sizes) -> list[dict]:
    rows = []
    bar = progress_bar(len(dtypes) * len(sizes), "add_relu backward")
    for dt in dtypes:
        for n in sizes:
            x, y = (torch.randn(n, device=device, dtype=dt, requires_grad=True) for _ in range(2))
            g = torch.randn(n, device=device, dtype=dt)
            row = {"dtype": str(dt).removeprefix("torch."), "n": n,
                   "bytes_backward": 3 * n * x.element_size()}
            for name, fn in impls.items():
                z = fn(x, y)
                grads = torch.autograd.grad(z, (x, y), g, retain_graph=True)
                want = torch.autograd.grad(_eager(x, y), (x, y), g)
                for got, ref in zip(grads, want):
                    torch.testing.assert_close(got, ref)
                us = _time_us(lambda: torch.autograd.grad(z, (x, y), g, retain_graph=True), device)
                row[f"{name}_bwd_us"] = us
                row[f"{name}_bwd_gbps"] = row["bytes_backward"] / us / 1e3
                row[f"{name}_fwd_bwd_us"] = _time_us(lambda: torch.autograd.grad(fn(x, y), (x, y), g), device)
                row[f"{name}_saved_bytes"] = _saved_bytes(fn, x, y)
                row[f"{name}_peak_bytes"] = _peak_bytes(fn, x, y, g, device)
                del z, grads
            rows.append(row)
            bar.update()
    bar.close()
    return rows


def run_linear_training(dtypes, device, shapes=LINEAR_TRAINING_SHAPES) -> list[dict]:
    """Forward + backward of ``fusedkit.nn.LinearReLU`` against ``nn.Sequential(nn.Linear, nn.ReLU)``
    with the same parameters: gradients of the input, weight and bias."""
    rows = []
    bar = progress_bar(len(dtypes) * len(shapes), "LinearReLU training")
    for dt in dtypes:
        if not dt.is_floating_point or (device.type == "cuda" and dt == torch.float64):
            continue
        for m, k, n in shapes:
            ref = torch.nn.Sequential(torch.nn.Linear(k, n), torch.nn.ReLU()).to(device, dt)
            fused = fusedkit.nn.LinearReLU.from_linear(ref[0])
            x = torch.randn(m, k, device=device, dtype=dt, requires_grad=True)
            g = torch.randn(m, n, device=device, dtype=dt)
            row = {"dtype": str(dt).removeprefix("torch."), "m": m, "k": k, "n": n,
                   "flops": 3 * 2 * m * n * k}  # forward, grad of x, grad of weight
            for name, module in (("fusedkit", fused), ("torch", ref)):
                params = (x, *module.parameters())
                row[f"{name}_us"] = _time_us(lambda: torch.autograd.grad(module(x), params, g), device)
            rows.append(row)
            bar.update()
    bar.close()
    return rows


def format_linear_table(rows: list[dict]) -> str:
    head = f"{'dtype':<9} {'M':>6} {'K':>6} {'N':>6} {'fusedkit us':>11} {'torch us':>9} {'TFLOP/s':>8} {'x torch':>7}"
    lines = ["LinearReLU forward + backward vs nn.Linear + nn.ReLU (do_bench medians; x = torch time / fusedkit time)",
             head, "-" * len(head)]
    for r in rows:
        f, t = r["fusedkit_us"], r["torch_us"]
        lines.append(f"{r['dtype']:<9} {r['m']:>6} {r['k']:>6} {r['n']:>6} {f:>11.1f} {t:>9.1f} "
                     f"{r['flops'] / f / 1e6:>8.1f} {t / f:>7.2f}")
    return "\n".join(lines)


def format_backward_table(rows: list[dict]) -> str:
    impls = [k.removesuffix("_bwd_gbps") for k in rows[0] if k.endswith("_bwd_gbps")] if rows else []
    head = f"{'dtype':<9} {'n':>10} " + " ".join(
        f"{i + ' bwd us':>16} {'GB/s':>6} {'fwd+bwd us':>10} {'saved MB':>8} {'peak MB':>8}" for i in impls)
    lines = ["add_relu backward (do_bench medians; GB/s over grad + saved output read, one gradient written)",
             head, "-" * len(head)]
    for r in rows:
        cells = []
        for i in impls:
            peak = r[f"{i}_peak_bytes"]
            cells.append(f"{r[f'{i}_bwd_us']:>16.1f} {r[f'{i}_bwd_gbps']:>6.0f} {r[f'{i}_fwd_bwd_us']:>10.1f} "
                         f"{r[f'{i}_saved_bytes'] / 1e6:>8.2f} {'-' if peak is None else format(peak / 1e6, '.2f'):>8}")
        lines.append(f"{r['dtype']:<9} {r['n']:>10} " + " ".join(cells))
    return "\n".join(lines)
