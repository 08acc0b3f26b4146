"""Small-tensor latency: ``python -m fusedkit bench --latency``.

At small sizes a call costs host time (validation, launch), not bytes. Each case
is called ``CALLS`` times back to back and synchronised once at the end, so the
per-call time is whichever is slower, the host issuing calls or the GPU running
them; the peers run in the same process on the same operands:
- elementwise (n = 1K, 64K, 1M): ``fusedkit.add`` / ``add_relu`` against
  ``torch.add``, ``torch.relu(x + y)`` and ``torch.compile`` of the latter; the
  registered ``torch.library`` op beside the direct eager path; and the cost
  per call inside a replayed CUDA graph of ``GRAPH_CALLS`` calls.
- linear + ReLU at decode-sized M: ``fusedkit.linear_relu`` against
  ``torch.relu(F.linear(x, w, b))``.
- the norms at decode- and block-sized rows: ``fusedkit.rms_norm`` / ``add_rms_norm`` /
  ``layer_norm`` / ``add_layer_norm`` against ``F.rms_norm`` / ``F.layer_norm`` (after
  ``x + r``), forward without a gradient and forward + backward.
- host time alone (:mod:`fusedkit.bench.host`): every public op against its eager
  composition, each call timed with the GPU idle, in one dtype (bf16 when asked for).
On a CPU the same harness runs the interpreter or the PyTorch path; those are not GPU times.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import fusedkit
from fusedkit import autograd
from fusedkit.library import ADD_RELU

from .host import HOST_MATMULS, HOST_ROWS, HOST_SIZES, format_host_table, host_steps, run_host
from .progress import bar as progress_bar

__all__ = ["run_latency", "format_latency_table", "merge_latency", "LATENCY_SIZES", "LINEAR_SHAPES", "NORM_SHAPES"]

#: Calls per timing, and rounds (the median is reported) on a GPU; far fewer on a CPU.
CALLS, ROUNDS = 2000, 5
CPU_CALLS, CPU_ROUNDS = 20, 3
GRAPH_CALLS = 200
LATENCY_SIZES = (1 << 10, 1 << 16, 1 << 20)
#: (M, K = N) of the decode-sized linear + ReLU cases.
LINEAR_SHAPES = ((1, 1024), (16, 1024), (64, 1024), (1, 4096), (16, 4096), (64, 4096))
#: (rows, n) of the norm cases: a decode step's, and a small block's.
NORM_SHAPES = ((1, 2048), (16, 2048), (64, 4096))
NORM_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_us(fn, device, calls: int | None = None, rounds: int | None = None) -> float:
    """Median over rounds of (time for ``calls`` back-to-back calls, synchronised at the end) / calls."""
    gpu = device.type == "cuda"
    calls = calls or (CALLS if gpu else CPU_CALLS)
    rounds = rounds or (ROUNDS if gpu else CPU_ROUNDS)
    for _ in range(min(calls, 50)):  # warm-up: compile, tune, fill caches
        fn()
    samples = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(samples)[len(samples) // 2]


def graph_call_us(fn, device) -> float | None:
    """Per-call time of ``fn`` replayed from one CUDA graph holding ``GRAPH_CALLS`` calls."""
    if device.type != "cuda":
        return None
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return per_call_us(graph.replay, device, calls=20) / GRAPH_CALLS


def _norm_calls(op: str, x, r, w, b):
    """(fusedkit's call, eager's composition) of norm ``op`` on rows ``x`` (residual ``r``,
    weight ``w``, bias ``b``): each returns the normalised rows."""
    n, eps = x.shape[-1], 1e-5
    rms, residual = "rms" in op, op.startswith("add_")
    fused = getattr(fusedkit, op)
    if rms:
        eager_norm = lambda h: F.rms_norm(h, (n,), w, eps)
        call = (lambda: fused(x, r, w, eps)[0]) if residual else (lambda: fused(x, (n,), w, eps))
    else:
        eager_norm = lambda h: F.layer_norm(h, (n,), w, b, eps)
        call = (lambda: fused(x, r, w, b, eps)[0]) if residual else (lambda: fused(x, (n,), w, b, eps))
    return call, (lambda: eager_norm(x + r)) if residual else (lambda: eager_norm(x))


def _norm_rows(dt, device, norm_shapes, bar) -> list[dict]:
    rows = []
    for m, n in norm_shapes:
        x, r, g = (torch.randn(m, n, device=device).to(dt) for _ in range(3))
        w, b = (torch.randn(n, device=device).to(dt) for _ in range(2))
        grads = [t.clone().requires_grad_() for t in (x, r, w, b)]
        for op in NORM_OPS:
            fused, eager = _norm_calls(op, x, r, w, b)
            fused_g, eager_g = _norm_calls(op, *grads)
            leaves = [t for t, used in zip(grads, (True, op.startswith("add_"), True, "rms" not in op)) if used]
            rows.append(
                {
                    "dtype": str(dt).removeprefix("torch."),
                    "rows": m,
                    "n": n,
                    "op": op,
                    "fusedkit": per_call_us(fused, device),
                    "eager": per_call_us(eager, device),
                    # a training step's share: forward and every input's gradient
                    "fusedkit fwd+bwd": per_call_us(
                        lambda f=fused_g, ls=leaves: torch.autograd.grad(f(), ls, g), device
                    ),
                    "eager fwd+bwd": per_call_us(lambda f=eager_g, ls=leaves: torch.autograd.grad(f(), ls, g), device),
                }
            )
        bar.update()
    return rows


def run_latency(
    dtypes,
    device,
    sizes=LATENCY_SIZES,
    linear_shapes=LINEAR_SHAPES,
    use_compile=True,
    progress=True,
    norm_shapes=NORM_SHAPES,
    host_grid=(HOST_SIZES, HOST_ROWS, HOST_MATMULS),
) -> dict:
    rows, linear, norms = [], [], []
    floats = [dt for dt in dtypes if dt.is_floating_point and dt != torch.float64]
    host_dtype = torch.bfloat16 if torch.bfloat16 in floats else (floats[0] if floats else None)
    steps = len(dtypes) * len(sizes) + len(floats) * (len(linear_shapes) + len(norm_shapes))
    steps += host_steps(*host_grid) if host_dtype is not None and host_grid else 0
    bar = progress_bar(steps, "latency", progress)
    for dt in dtypes:
        for n in sizes:
            x, y = (torch.randn(n, device=device).to(dt) for _ in range(2))
            cases = {
                "torch.add": lambda: torch.add(x, y),
                "relu(x + y)": lambda: torch.relu(x + y),
                "fusedkit.add": lambda: fusedkit.add(x, y),
                "fusedkit.add_relu": lambda: fusedkit.add_relu(x, y),
                "add_relu via op": lambda: autograd.call_op(ADD_RELU, (x, y), 1, None),
            }
            if dt.is_floating_point:
                # Training-mode calls: the inputs need a gradient, so autograd records each
                # call; fwd+bwd also takes the gradients (torch.autograd.grad: nothing accumulates).
                xg, yg = (t.clone().requires_grad_() for t in (x, y))
                g = torch.randn_like(x)
                cases["relu(x + y) grad"] = lambda: torch.relu(xg + yg)
                cases["fusedkit.add_relu grad"] = lambda: fusedkit.add_relu(xg, yg)
                cases["relu(x + y) fwd+bwd"] = lambda: torch.autograd.grad(torch.relu(xg + yg), (xg, yg), g)
                cases["fusedkit.add_relu fwd+bwd"] = lambda: torch.autograd.grad(fusedkit.add_relu(xg, yg), (xg, yg), g)
            if use_compile and device.type == "cuda":
                compiled = torch.compile(lambda a, b: torch.relu(a + b))
                cases["compiled relu(x + y)"] = lambda: compiled(x, y)
            row = {"dtype": str(dt).removeprefix("torch."), "n": n}
            for name, fn in cases.items():
                row[name] = per_call_us(fn, device)
            row["graph torch.add"] = graph_call_us(lambda: torch.add(x, y), device)
            row["graph fusedkit.add_relu"] = graph_call_us(lambda: fusedkit.add_relu(x, y), device)
            rows.append(row)
            bar.update()
        if not dt.is_floating_point or dt == torch.float64:
            continue
        norms += _norm_rows(dt, device, norm_shapes, bar)
        for m, k in linear_shapes:
            a = torch.randn(m, k, device=device).to(dt)
            w = torch.randn(k, k, device=device).to(dt) / k**0.5
            b = torch.randn(k, device=device).to(dt)
            ag, wg, bg = (t.clone().requires_grad_() for t in (a, w, b))
            g = torch.randn(m, k, device=device).to(dt)
            linear.append(
                {
                    "dtype": str(dt).removeprefix("torch."),
                    "m": m,
                    "k": k,
                    "n": k,
                    "fusedkit.linear_relu": per_call_us(lambda: fusedkit.linear_relu(a, w, b), device),
                    "relu(F.linear)": per_call_us(lambda: torch.relu(F.linear(a, w, b)), device),
                    # A training step's share: forward and the gradients of input, weight and bias.
                    "fusedkit.linear_relu fwd+bwd": per_call_us(
                        lambda: torch.autograd.grad(fusedkit.linear_relu(ag, wg, bg), (ag, wg, bg), g), device
                    ),
                    "relu(F.linear) fwd+bwd": per_call_us(
                        lambda: torch.autograd.grad(torch.relu(F.linear(ag, wg, bg)), (ag, wg, bg), g), device
                    ),
                }
            )
            bar.update()
    host = run_host(host_dtype, device, *host_grid, bar=bar) if host_dtype is not None and host_grid else []
    bar.close()
    result = {"elementwise": rows, "linear": linear, "norms": norms, "host": host}
    if host:
        result["host dtype"] = str(host_dtype).removeprefix("torch.")
    return result


def merge_latency(results: list[dict]) -> dict:
    """One latency result from several processes' (the same grid in each, rows in one order):
    each time the median of the processes', and each host row its ratio's range."""
    merged = {k: v for k, v in results[0].items() if k != "environment"}
    for section in ("elementwise", "linear", "norms", "host"):
        rows = []
        grids = [[_label(row) for row in r.get(section) or []] for r in results]
        if any(g != grids[0] for g in grids):
            raise ValueError(f"the processes' {section} rows differ: {grids}")
        for cells in zip(*(r.get(section) or [] for r in results)):
            row = {}
            for key, first in cells[0].items():
                values = [c.get(key) for c in cells]
                numbers = all(isinstance(v, float) for v in values)
                row[key] = statistics.median(values) if numbers else first
            if section == "host":
                ratios = [c["fusedkit host"] / c["eager host"] for c in cells]
                row["ratio range"] = [min(ratios), max(ratios)]
            rows.append(row)
        merged[section] = rows
    merged["processes"] = len(results)
    return merged


def _label(row: dict) -> tuple:
    """What a row is of (its op, sizes, dtype, mode): its fields that are not times."""
    return tuple((k, v) for k, v in row.items() if not isinstance(v, float) and v is not None)


def format_latency_table(result: dict) -> str:
    rows, linear = result["elementwise"], result["linear"]
    lines = []
    if rows:
        names = [k for k in rows[0] if k not in ("dtype", "n")]
        head = f"{'dtype':<9} {'n':>8} " + " ".join(f"{k:>{max(9, len(k))}}" for k in names)
        lines += [
            "us per call (back-to-back calls, synchronised at the end; graph = per call inside a replayed CUDA graph)",
            head,
            "-" * len(head),
        ]
        for r in rows:
            cells = " ".join(f"{'-' if r.get(k) is None else format(r[k], '.1f'):>{max(9, len(k))}}" for k in names)
            lines.append(f"{r['dtype']:<9} {r['n']:>8} {cells}")
        lines.append(
            "ratios to torch.add: "
            + "; ".join(
                f"{r['dtype']} n={r['n']}: add {r['fusedkit.add'] / r['torch.add']:.2f}x, "
                f"add_relu {r['fusedkit.add_relu'] / r['torch.add']:.2f}x"
                for r in rows
            )
        )
        lines.append(
            "fwd+bwd, add_relu / relu(x + y): "
            + "; ".join(
                f"{r['dtype']} n={r['n']}: {r['fusedkit.add_relu fwd+bwd'] / r['relu(x + y) fwd+bwd']:.2f}x"
                for r in rows
                if r.get("fusedkit.add_relu fwd+bwd")
            )
        )
    if linear:
        lines += [
            "",
            f"{'dtype':<9} {'M':>4} {'K=N':>6} {'fusedkit':>9} {'relu(F.linear)':>14} {'ratio':>6} "
            f"{'fwd+bwd':>9} {'torch fwd+bwd':>13} {'ratio':>6}",
        ]
        for r in linear:
            f, t = r["fusedkit.linear_relu"], r["relu(F.linear)"]
            fb, tb = r["fusedkit.linear_relu fwd+bwd"], r["relu(F.linear) fwd+bwd"]
            lines.append(
                f"{r['dtype']:<9} {r['m']:>4} {r['k']:>6} {f:>9.1f} {t:>14.1f} {f / t:>6.2f} "
                f"{fb:>9.1f} {tb:>13.1f} {fb / tb:>6.2f}"
            )
    norms = result.get("norms") or []
    if norms:
        lines += [
            "",
            f"{'dtype':<9} {'rows':>5} {'n':>6} {'op':<15} {'fusedkit':>9} {'eager':>7} {'ratio':>6} "
            f"{'fwd+bwd':>9} {'eager fwd+bwd':>13} {'ratio':>6}",
        ]
        for r in norms:
            f, t, fb, tb = r["fusedkit"], r["eager"], r["fusedkit fwd+bwd"], r["eager fwd+bwd"]
            lines.append(
                f"{r['dtype']:<9} {r['rows']:>5} {r['n']:>6} {r['op']:<15} {f:>9.1f} {t:>7.1f} {f / t:>6.2f} "
                f"{fb:>9.1f} {tb:>13.1f} {fb / tb:>6.2f}"
            )
    host = result.get("host") or []
    if host:
        lines += ["", format_host_table(host, result.get("host dtype", ""), result.get("processes", 1))]
    return "\n".join(lines)
