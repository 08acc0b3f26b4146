"""Backward and memory report: ``python -m fusedkit bench --backward``.

For ``z = op(x, y)`` with x, y requiring grad, for each op of ``BACKWARD_OPS`` (add_relu,
the SwiGLU gate, the GeGLU gates with exact and tanh GELU, bias + GELU):
- backward time (``torch.autograd.grad`` of a retained graph, ``do_bench`` median)
  and GB/s over the bytes the fused backward moves (add_relu: read the incoming gradient
  and the saved output, write one gradient, alpha = 1 giving y the same tensor; a gate:
  read the gradient, a and b, write both gradients; add_gelu: read the gradient, x and y,
  write one), for fusedkit, the eager composition and ``torch.compile`` of it;
- bytes saved for backward, counted with ``torch.autograd.graph.saved_tensors_hooks``
  (distinct storages), and the peak memory above the inputs of forward + backward
  (``torch.cuda.max_memory_allocated``), for the same three.
On a CPU the harness runs at small sizes; its times are not GPU times.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import fusedkit

from .cases import timer
from .progress import bar as progress_bar

__all__ = [
    "keep_saved_buffers",
    "run_backward",
    "format_backward_table",
    "run_linear_training",
    "format_linear_table",
    "BACKWARD_OPS",
    "BACKWARD_SIZES",
    "LINEAR_TRAINING_SHAPES",
]

BACKWARD_SIZES = (1 << 24, 1 << 28)
CPU_BACKWARD_SIZES = (1 << 10,)
#: (tokens M, in K, out N) of the LinearReLU training step: an MLP up-projection.
LINEAR_TRAINING_SHAPES = ((4096, 4096, 4096), (8192, 4096, 11008))
CPU_LINEAR_TRAINING_SHAPES = ((32, 48, 40),)


def _eager(x, y):
    return torch.relu(x + y)


#: Each op of the report: (fusedkit's, the eager composition, tensors of n elements its
#: fused backward reads and writes).
BACKWARD_OPS = {
    "add_relu": (fusedkit.add_relu, _eager, 3),
    "silu_mul": (fusedkit.silu_mul, lambda a, b: F.silu(a) * b, 5),
    "gelu_mul": (fusedkit.gelu_mul, lambda a, b: F.gelu(a) * b, 5),
    "gelu_tanh_mul": (
        lambda a, b: fusedkit.gelu_mul(a, b, approximate="tanh"),
        lambda a, b: F.gelu(a, approximate="tanh") * b,
        5,
    ),
    "add_gelu": (fusedkit.add_gelu, lambda x, y: F.gelu(x + y), 3),  # grad and the kept sum in, one out
}


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


def run_backward(dtypes, device, sizes=BACKWARD_SIZES, use_compile=True, ops=tuple(BACKWARD_OPS)) -> list[dict]:
    """One row per op, dtype and size (see the module's docstring)."""
    rows = []
    with keep_saved_buffers():
        for op in ops:
            fused, eager, tensors = BACKWARD_OPS[op]
            impls = {"fusedkit": fused, "eager": eager}
            if use_compile and device.type == "cuda":
                impls["compiled"] = torch.compile(eager)
            rows += _run_backward(op, impls, tensors, dtypes, device, sizes)
    return rows


def _run_backward(op, impls, tensors, dtypes, device, sizes) -> list[dict]:
    rows = []
    eager = impls["eager"]
    bar = progress_bar(len(dtypes) * len(sizes), f"{op} backward")
    for dt in dtypes:
        for n in sizes:
            x, y = (torch.randn(n, device=device, dtype=dt, requires_grad=True) for _ in range(2))
            g = torch.randn(n, device=device, dtype=dt)
            row = {
                "op": op,
                "dtype": str(dt).removeprefix("torch."),
                "n": n,
                "bytes_backward": tensors * n * x.element_size(),
            }
            want = torch.autograd.grad(eager(x, y), (x, y), g)
            for name, fn in impls.items():
                z = fn(x, y)
                grads = torch.autograd.grad(z, (x, y), g, retain_graph=True)
                for got, ref in zip(grads, want):
                    torch.testing.assert_close(got, ref, **_TOLERANCE.get(dt, {}))
                us = _time_us(lambda z=z: torch.autograd.grad(z, (x, y), g, retain_graph=True), device)
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


#: The check against the eager composition: fusedkit computes half types in float32 and rounds
#: once, the composition after each op (2 ulps apart at most).
_TOLERANCE = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=4e-3, atol=4e-3)}


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
            row = {
                "dtype": str(dt).removeprefix("torch."),
                "m": m,
                "k": k,
                "n": n,
                "flops": 3 * 2 * m * n * k,
            }  # forward, grad of x, grad of weight
            for name, module in (("fusedkit", fused), ("torch", ref)):
                params = (x, *module.parameters())
                row[f"{name}_us"] = _time_us(lambda: torch.autograd.grad(module(x), params, g), device)
            rows.append(row)
            bar.update()
    bar.close()
    return rows


def format_linear_table(rows: list[dict]) -> str:
    head = f"{'dtype':<9} {'M':>6} {'K':>6} {'N':>6} {'fusedkit us':>11} {'torch us':>9} {'TFLOP/s':>8} {'x torch':>7}"
    lines = [
        "LinearReLU forward + backward vs nn.Linear + nn.ReLU (do_bench medians; x = torch time / fusedkit time)",
        head,
        "-" * len(head),
    ]
    for r in rows:
        f, t = r["fusedkit_us"], r["torch_us"]
        lines.append(
            f"{r['dtype']:<9} {r['m']:>6} {r['k']:>6} {r['n']:>6} {f:>11.1f} {t:>9.1f} "
            f"{r['flops'] / f / 1e6:>8.1f} {t / f:>7.2f}"
        )
    return "\n".join(lines)


def format_backward_table(rows: list[dict]) -> str:
    impls = [k.removesuffix("_bwd_gbps") for k in rows[0] if k.endswith("_bwd_gbps")] if rows else []
    head = f"{'op':<14} {'dtype':<9} {'n':>10} " + " ".join(
        f"{i + ' bwd us':>16} {'GB/s':>6} {'fwd+bwd us':>10} {'saved MB':>8} {'peak MB':>8}" for i in impls
    )
    lines = [
        "Backward (do_bench medians; GB/s over what the fused backward reads and writes; saved: what autograd "
        "keeps beyond the inputs)",
        head,
        "-" * len(head),
    ]
    for r in rows:
        cells = []
        for i in impls:
            peak = r.get(f"{i}_peak_bytes")
            cells.append(
                f"{r[f'{i}_bwd_us']:>16.1f} {r[f'{i}_bwd_gbps']:>6.0f} {r[f'{i}_fwd_bwd_us']:>10.1f} "
                f"{r[f'{i}_saved_bytes'] / 1e6:>8.2f} {'-' if peak is None else format(peak / 1e6, '.2f'):>8}"
            )
        lines.append(f"{r.get('op', 'add_relu'):<14} {r['dtype']:<9} {r['n']:>10} " + " ".join(cells))
    return "\n".join(lines)
