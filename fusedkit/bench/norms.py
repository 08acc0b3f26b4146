"""The norm family's report: ``python -m fusedkit bench --norms``.

For each norm of ``fusedkit.registry.row_kernels()`` at each (rows, width) of the report:

- fusedkit's forward alone and backward alone: the GPU's busy time (on a CPU, the wall time),
  GB/s over their byte models (``RowKernel.bytes_fused``, ``RowKernel.bytes_backward``) and
  that as a share of the copy roof (``Tensor.copy_`` of the same bytes, measured in the same
  process);
- forward + backward (the output's and, for add + norm, the residual stream's gradient
  flowing; every input's and parameter's gradient) of fusedkit, the eager composition
  (``torch.add`` then ``F.rms_norm`` / ``F.layer_norm``, torch's own kernels), its
  ``torch.compile`` and Liger-Kernel (``LigerFusedAddRMSNorm``, ``LigerRMSNorm``,
  ``LigerLayerNorm`` after an eager add) where it imports, with each one's largest
  difference from a float64 reference. Each twice: the GPU's busy time (its kernels' durations
  summed) and the wall time of an eager launch, host included: at the smaller shapes an eager
  step is bound by the host that issues it, and the busy time tells the kernels apart.

Inputs and parameters in bf16 (or the dtypes asked for), as a model cast with ``.to(dtype)``
holds them. On a CPU the harness runs at small sizes; its times are not GPU times.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fusedkit
from fusedkit import registry

from .cases import timer
from .models import gpu_busy_ms
from .progress import bar as progress_bar

__all__ = ["CPU_NORM_SHAPES", "NORM_SHAPES", "format_norms_table", "run_norms"]

#: (rows, width): LLaMA-1B and 7B widths and ViT / BERT widths at 8192-16384 rows (the
#: speedup goals), then 2**28 elements at rows of 4096 and 8192 (the bandwidth goal).
NORM_SHAPES = (
    (16384, 768),
    (16384, 1024),
    (8192, 2048),
    (8192, 4096),
    (65536, 4096),
    (32768, 8192),
)
CPU_NORM_SHAPES = ((8, 96),)
#: Calls profiled together for a GPU busy time.
GPU_CALLS = 10


def _eager(kernel):
    def run(x, r, w, b):
        h = torch.add(x, r) if kernel.residual else x
        y = F.rms_norm(h, w.shape, w, 1e-6) if kernel.rms else F.layer_norm(h, w.shape, w, b, 1e-6)
        return (y, h) if kernel.residual else (y,)

    return run


def _fusedkit(kernel):
    op = getattr(fusedkit, kernel.name)

    def run(x, r, w, b):
        if kernel.residual:
            return op(x, r, w, 1e-6) if kernel.rms else op(x, r, w, b, 1e-6)
        return (op(x, w.shape, w, 1e-6) if kernel.rms else op(x, w.shape, w, b, 1e-6),)

    return run


def _liger(kernel, n: int, device):
    """Liger-Kernel's module for ``kernel`` (sharing the report's weights), or None."""
    try:
        if kernel.rms and kernel.residual:
            from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm as cls
        elif kernel.rms:
            from liger_kernel.transformers.rms_norm import LigerRMSNorm as cls
        else:
            from liger_kernel.transformers.layer_norm import LigerLayerNorm as cls
    except ImportError:
        return None
    module = cls(n, eps=1e-6).to(device)

    def run(x, r, w, b):
        module.weight = w
        if not kernel.rms:
            module.bias = b
        if kernel.rms and kernel.residual:
            return tuple(module(x, r))
        h = torch.add(x, r) if kernel.residual else x
        return (module(h), h) if kernel.residual else (module(h),)

    return run


def run_norms(dtypes, device, shapes=NORM_SHAPES, use_compile=True, peers=True) -> list[dict]:
    """One row per norm, dtype and shape (see the module's docstring)."""
    time_us, gpu_us = timer(device), _gpu_timer(device)
    rows = []
    kernels = registry.row_kernels()
    bar = progress_bar(len(kernels) * len(dtypes) * len(shapes), "norms")
    for dt in dtypes:
        for m, n in shapes:
            x = torch.randn(m, n, device=device, dtype=dt)
            roof = 2 * x.numel() * x.element_size() / time_us(lambda x=x: torch.empty_like(x).copy_(x)) / 1e3
            for kernel in kernels:
                rows.append(_row(kernel, dt, m, n, device, time_us, gpu_us, roof, use_compile, peers))
                bar.update()
    bar.close()
    return rows


def _row(kernel, dt, m, n, device, time_us, gpu_us, roof, use_compile, peers) -> dict:
    x, r = (torch.randn(m, n, device=device, dtype=dt, requires_grad=True) for _ in range(2))
    # (parameters in the input's dtype, as a model cast with ``.to(dtype)`` holds them and as
    # F.layer_norm takes them; Parameters, so that Liger's module differentiates these ones)
    w = torch.nn.Parameter(1 + 0.1 * torch.randn(n, device=device, dtype=dt))
    b = torch.nn.Parameter(0.1 * torch.randn(n, device=device, dtype=dt)) if not kernel.rms else None
    leaves = [t for t in (x, r if kernel.residual else None, w, b) if t is not None]
    impls = {"fusedkit": _fusedkit(kernel), "eager": _eager(kernel)}
    if use_compile:  # (a fresh compile a row: the report's shapes pass Dynamo's recompile limit)
        torch._dynamo.reset()
        impls["compiled"] = torch.compile(_eager(kernel))
    liger = _liger(kernel, n, device) if peers and device.type == "cuda" else None
    if liger is not None:
        impls["liger"] = liger
    fused_bytes = kernel.bytes_fused(m, n, dt)
    row = {"op": kernel.name, "dtype": str(dt).removeprefix("torch."), "rows": m, "n": n, "copy_gbps": roof}
    want = _eager(kernel)(*(None if t is None else t.detach().double() for t in (x, r, w, b)))
    grads = [torch.randn_like(out, dtype=dt) for out in want]
    for name, fn in impls.items():
        try:
            outs = fn(x, r, w, b)
            row[f"{name}_err"] = max((o.double() - t).abs().max().item() for o, t in zip(outs, want))
            grad = [g.to(o.dtype) for g, o in zip(grads, outs)]

            def forward(fn=fn):
                with torch.no_grad():
                    return fn(x, r, w, b)

            def step(fn=fn, grad=grad):
                return torch.autograd.grad(fn(x, r, w, b), leaves, grad)

            row[f"{name}_fwd_us"] = time_us(forward)
            row[f"{name}_fwd_bwd_us"] = time_us(step)
            row[f"{name}_fwd_bwd_gpu_us"] = gpu_us(step)
            if name == "fusedkit":  # forward and backward alone, over their compulsory bytes

                def backward(outs=outs, grad=grad):
                    return torch.autograd.grad(outs, leaves, grad, retain_graph=True)

                # (the GPU's time where there is one: a wall time at these sizes is the host's)
                row["fusedkit_fwd_gpu_us"] = gpu_us(forward)
                row["fusedkit_bwd_us"] = gpu_us(backward) or time_us(backward)
        except Exception as exc:  # a peer that refuses a shape or dtype: its cells stay empty
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    us = row.get("fusedkit_fwd_gpu_us") or row.get("fusedkit_fwd_us")
    if us:
        row["fusedkit_fwd_gbps"] = fused_bytes.total / us / 1e3
        row["fusedkit_roof_share"] = row["fusedkit_fwd_gbps"] / roof
    us = row.get("fusedkit_bwd_us")
    if us:
        row["fusedkit_bwd_gbps"] = kernel.bytes_backward(m, n, dt, dt).total / us / 1e3
        row["fusedkit_bwd_roof_share"] = row["fusedkit_bwd_gbps"] / roof
    return row


def _gpu_timer(device):
    """GPU busy time of ``fn`` in microseconds: its kernels' durations summed (``torch.profiler``,
    over ``GPU_CALLS`` calls: no host time, which bounds an eager step at these sizes), the L2
    cleared before each call as do_bench clears it (a 256 MB fill, whose own time is taken
    off); None off a GPU. (Not CUDA-graph replays: capturing an autograd step failed on the
    H200 and left the RNG unusable.)"""
    if device.type != "cuda":
        return lambda fn: None
    cache = torch.empty(2**26, dtype=torch.int32, device=device)
    fill_us = 1e3 * gpu_busy_ms(cache.zero_, device, GPU_CALLS)

    def gpu(fn):
        def flushed():
            cache.zero_()
            return fn()

        return 1e3 * gpu_busy_ms(flushed, device, GPU_CALLS) - fill_us

    return gpu


def format_norms_table(rows: list[dict]) -> str:
    impls = [i for i in ("fusedkit", "eager", "compiled", "liger") if any(f"{i}_fwd_bwd_us" in r for r in rows)]
    head = (
        f"{'op':<15} {'dtype':<9} {'rows':>6} {'n':>5} {'fwd us':>7} {'roof':>5} {'bwd us':>7} {'roof':>5} "
        + " ".join(f"{i[:8] + ' gpu':>12}" for i in impls)
        + " "
        + " ".join(f"{'x ' + i[:8]:>10}" for i in impls[1:])
        + " "
        + " ".join(f"{i[:8] + ' wall':>13}" for i in impls)
    )
    lines = [
        "Norms: fusedkit's forward and backward alone, GPU busy time (kernels summed) against the copy roof "
        "(their compulsory bytes); forward + backward of each, GPU busy time and wall time (launched eagerly, "
        "host included; do_bench medians), in us; x = that one's GPU time / fusedkit's",
        head,
        "-" * len(head),
    ]

    def num(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        mine = r.get("fusedkit_fwd_bwd_gpu_us")
        gpu = " ".join(f"{num(r.get(f'{i}_fwd_bwd_gpu_us'), '.1f'):>12}" for i in impls)
        ratios = " ".join(
            f"{num(r[f'{i}_fwd_bwd_gpu_us'] / mine if mine and r.get(f'{i}_fwd_bwd_gpu_us') else None, '.2f'):>10}"
            for i in impls[1:]
        )
        wall = " ".join(f"{num(r.get(f'{i}_fwd_bwd_us'), '.1f'):>13}" for i in impls)
        fwd_us = r.get("fusedkit_fwd_gpu_us") or r.get("fusedkit_fwd_us")
        fwd = f"{num(fwd_us, '.1f'):>7} {num(r.get('fusedkit_roof_share'), '.0%'):>5}"
        bwd = f"{num(r.get('fusedkit_bwd_us'), '.1f'):>7} {num(r.get('fusedkit_bwd_roof_share'), '.0%'):>5}"
        lines.append(f"{r['op']:<15} {r['dtype']:<9} {r['rows']:>6} {r['n']:>5} {fwd} {bwd} {gpu} {ratios} {wall}")
    for r in rows:
        for i in impls:
            if f"{i}_error" in r:
                lines.append(f"{r['op']} {r['rows']}x{r['n']} {i}: {r[f'{i}_error']}")
    return "\n".join(lines)
