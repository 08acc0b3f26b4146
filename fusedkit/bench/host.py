"""Host time per call: every public op against its eager composition (the latency report's
host table, ``python -m fusedkit bench --latency``).

A model bound by its host (a decode step, a small block) runs at the speed its Python and
launches issue work, so a fused op that costs more host time than the ops it replaces makes it
slower whatever its kernels save. Here each call is timed alone with the GPU idle (synchronised
before the call, not after it): what the host spends to issue it, its autograd node, its
gradients' launches and freeing its result. A round is the median of ``HOST_CALLS`` such calls;
fused and eager rounds alternate (A/B, so a host that drifts moves both); each side's number is
its best round. ``--processes N`` runs the report in N processes, every other one starting with
eager, and gives each number's median and the ratio's range; ``--pin`` holds them to one core.

The grid: the elementwise ops and the norms at 1K, 64K and 1M elements; the matmul family
(``matmul``, its GELU epilogue, ``linear_relu``, ``mlp``, ``gated_mlp``, square layers) at
M = 1, 16, 64, 512 with K = N = 1024 and 4096; forward without a gradient, and forward +
backward (``torch.autograd.grad`` of every input).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

import fusedkit
from fusedkit import registry, settings

from .processes import PROCESS_ENV

__all__ = ["run_host", "format_host_table", "HOST_SIZES", "HOST_ROWS", "HOST_MATMULS"]

#: Single calls a round, and rounds a side, on a GPU; a CPU only checks the harness.
HOST_CALLS, HOST_ROUNDS = 40, 6
CPU_HOST_CALLS, CPU_HOST_ROUNDS = 2, 1
#: Elements of the elementwise cases.
HOST_SIZES = (1 << 10, 1 << 16, 1 << 20)
#: (rows, n) of the norm cases: 1K, 64K and 1M elements.
HOST_ROWS = ((1, 1024), (16, 4096), (256, 4096))
#: (M, K = N) of the matmul cases.
HOST_MATMULS = tuple((m, k) for k in (1024, 4096) for m in (1, 16, 64, 512))


def _elementwise_cases(n, dtype, device):
    """(op, shape, fused, eager, operands) of each registry op that model code calls (those with
    a backward): its public function where it has one, ``fusedkit.elementwise`` otherwise;
    eager is the registry's reference."""
    for spec in registry.kernels():
        if spec.backward is None or dtype not in spec.dtypes:
            continue
        public = getattr(fusedkit, spec.name, None)
        param = (spec.param_default,) if spec.param else ()

        def fused(x, y, public=public, spec=spec):
            return public(x, y) if public is not None else fusedkit.elementwise(spec.name, x, y)

        def eager(x, y, spec=spec, param=param):
            return spec.reference(x, y, *param)

        shapes = ((n,), (n,))
        yield spec.name, str(n), fused, eager, shapes


def _norm_cases(rows, n, dtype, device):
    eps = 1e-5
    rms = lambda x, w: F.rms_norm(x, (n,), w, eps)
    ln = lambda x, w, b: F.layer_norm(x, (n,), w, b, eps)
    shape = f"{rows}x{n}"
    x, w = (rows, n), (n,)
    yield "rms_norm", shape, lambda x, w: fusedkit.rms_norm(x, (n,), w, eps), rms, (x, w)
    yield "layer_norm", shape, lambda x, w, b: fusedkit.layer_norm(x, (n,), w, b, eps), ln, (x, w, w)
    yield (
        "add_rms_norm",
        shape,
        lambda x, r, w: fusedkit.add_rms_norm(x, r, w, eps)[0],
        lambda x, r, w: rms(x + r, w),
        (x, x, w),
    )
    yield (
        "add_layer_norm",
        shape,
        lambda x, r, w, b: fusedkit.add_layer_norm(x, r, w, b, eps)[0],
        lambda x, r, w, b: ln(x + r, w, b),
        (x, x, w, w),
    )


def _matmul_cases(m, k, dtype, device):
    shape = f"{m}x{k}x{k}"
    a, w, b = (m, k), (k, k), (k,)
    yield "matmul", shape, lambda a, w, b: fusedkit.matmul(a, w.t(), b), F.linear, (a, w, b)
    yield (
        "matmul gelu",
        shape,
        lambda a, w, b: fusedkit.matmul(a, w.t(), b, "gelu"),
        lambda a, w, b: F.gelu(F.linear(a, w, b)),
        (a, w, b),
    )
    yield "linear_relu", shape, fusedkit.linear_relu, lambda a, w, b: torch.relu(F.linear(a, w, b)), (a, w, b)
    yield (
        "mlp",
        shape,
        lambda x, w1, b1, w2, b2: fusedkit.mlp(x, w1, b1, w2, b2),
        lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2),
        (a, w, b, w, b),
    )
    yield (
        "gated_mlp",
        shape,
        fusedkit.gated_mlp,
        lambda x, wg, wu, wd: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd),
        (a, w, w, w),
    )


def host_pair(fused, eager, device, calls: int, rounds: int, eager_first: bool = False) -> tuple[float, float]:
    """(fused, eager) µs of host time a call: each call timed alone after a synchronise, a
    round the median of ``calls`` of them, the two sides' rounds in turn, each side's best."""
    gpu = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if gpu else (lambda: None)
    sides = (eager, fused) if eager_first else (fused, eager)
    for fn in sides:  # warm-up: compile, plan, keep the launches
        for _ in range(3 if gpu else 1):
            fn()
    best = {fn: float("inf") for fn in sides}
    for _ in range(rounds):
        for fn in sides:
            samples = []
            for _ in range(calls):
                sync()
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            best[fn] = min(best[fn], statistics.median(samples) * 1e6)
    sync()
    return best[fused], best[eager]


def run_host(
    dtype, device, sizes=HOST_SIZES, rows=HOST_ROWS, matmuls=HOST_MATMULS, bar=None, calls=None, rounds=None
) -> list[dict]:
    """One row per op, size and mode ("forward": no gradient; "fwd+bwd": the gradients of every
    input through ``torch.autograd.grad``), with fusedkit's and eager's host µs a call."""
    gpu = device.type == "cuda"
    calls = calls or (HOST_CALLS if gpu else CPU_HOST_CALLS)
    rounds = rounds or (HOST_ROUNDS if gpu else CPU_HOST_ROUNDS)
    eager_first = int(os.environ.get(PROCESS_ENV, "0")) % 2 == 1
    groups = (
        [(_elementwise_cases, (n,)) for n in sizes]
        + [(_norm_cases, s) for s in rows]
        + [(_matmul_cases, s) for s in matmuls]
    )
    out = []
    # (one fixed matmul tile: a tuned call's later calls take the same host path, and tuning
    # the MLPs' four GEMMs at eight shapes would take most of a device call)
    with settings.override(autotune=False):
        for cases, args in groups:
            out += _host_rows(cases, args, dtype, device, calls, rounds, eager_first)
            if bar is not None:
                bar.update()
    return out


def _host_rows(cases, args, dtype, device, calls, rounds, eager_first) -> list[dict]:
    """The rows of one group of cases (an op family at one size), forward and forward + backward."""
    out = []
    for op, shape, fused, eager, shapes in cases(*args, dtype, device):
        # (a layer's scale: a matmul's operands as a model's weights would be, no overflow)
        tensors = [torch.randn(s, device=device).div_(s[-1] ** 0.5).to(dtype) for s in shapes]
        leaves = [t.clone().requires_grad_() for t in tensors]
        dy = torch.randn_like(fused(*tensors))
        for mode, call_fused, call_eager in (
            ("forward", lambda f=fused, t=tensors: f(*t), lambda e=eager, t=tensors: e(*t)),
            (
                "fwd+bwd",
                lambda f=fused, ls=leaves, g=dy: torch.autograd.grad(f(*ls), ls, g, allow_unused=True),
                lambda e=eager, ls=leaves, g=dy: torch.autograd.grad(e(*ls), ls, g, allow_unused=True),
            ),
        ):
            f_us, e_us = host_pair(call_fused, call_eager, device, calls, rounds, eager_first)
            out.append({"op": op, "shape": shape, "mode": mode, "fusedkit host": f_us, "eager host": e_us})
    return out


def host_steps(sizes=HOST_SIZES, rows=HOST_ROWS, matmuls=HOST_MATMULS) -> int:
    """The progress bar's steps :func:`run_host` takes."""
    return len(sizes) + len(rows) + len(matmuls)


def format_host_table(rows: list[dict], dtype: str = "", processes: int = 1) -> str:
    if not rows:
        return ""
    spread = processes > 1
    lines = [
        f"host us a call{' (' + dtype + ')' if dtype else ''}, the GPU idle before each call: best of alternating "
        f"fused/eager rounds{f', median of {processes} processes' if spread else ''}; ratio = fusedkit / eager "
        "(below 1: fusedkit issues faster)",
        f"{'op':<15} {'shape':>12} {'mode':<8} {'fusedkit':>9} {'eager':>9} {'ratio':>6}"
        + (" range" if spread else ""),
    ]
    for r in rows:
        ratio = r["fusedkit host"] / r["eager host"]
        cell = f" {r['ratio range'][0]:.2f}-{r['ratio range'][1]:.2f}" if spread and r.get("ratio range") else ""
        lines.append(
            f"{r['op']:<15} {r['shape']:>12} {r['mode']:<8} {r['fusedkit host']:9.1f} {r['eager host']:9.1f} "
            f"{ratio:6.2f}{cell}"
        )
    ratios = [r["fusedkit host"] / r["eager host"] for r in rows]
    over = sum(x > 1.0 for x in ratios)
    lines.append(
        f"{len(rows) - over} of {len(rows)} rows at or below eager's host time; "
        f"ratios {min(ratios):.2f}-{max(ratios):.2f}, median {statistics.median(ratios):.2f}"
    )
    return "\n".join(lines)
