"""``python -m fusedkit advise``: :func:`fusedkit.advise` and :func:`fusedkit.fuse` on the model
report's real models (:mod:`fusedkit.bench.models`, stock: no fusedkit put in by hand).

For each model: the sites fusedkit finds (pattern, module, bytes saved per forward pass at
the report's training batch) and the time of the model ``fuse`` returns against the
original's, an inference forward and a forward + backward, ``do_bench`` medians in one
process (bf16 autocast on a GPU, as the model report runs; tiny sizes in float32 on a CPU,
a check of the harness). A model ``torch.fx`` cannot trace is named with the reason.
"""

from __future__ import annotations

import copy
import statistics

import torch

import fusedkit

from . import models as M
from .progress import bar as progress_bar
from .report import copy_roof_gbps, environment, print_report

__all__ = ["format_advice", "gpu_saved_ms", "run_advice", "run_advise_command"]


def _step(model, case, x, target):
    """A forward and backward of ``model`` (its gradients dropped after)."""

    def run():
        with M.autocast_for(x.device):
            out = model(x)
        case.loss(out, target).backward()
        for p in model.parameters():
            p.grad = None

    return run


#: Forwards profiled together for the GPU busy time (one kernel's duration varies by a few %).
GPU_BUSY_CALLS = 5
#: bf16 elements of the copy that measures the bandwidth roof (1 GiB each way: far above L2).
ROOF_COPY_ELEMENTS = 1 << 29


def run_advice(names, device, small: bool | None = None, progress=True) -> tuple[list, list, dict]:
    """(sites: one dict per site, timings: one dict per model, skipped: {model: why}). A timing
    predicts the forward's saving from its bytes saved at the copy roof (``predicted_ms``)."""
    small = device.type != "cuda" if small is None else small
    sites, timings, skipped = [], [], {}
    # The rate a saved byte is predicted to save time at: the copy bandwidth measured now.
    roof = copy_roof_gbps(torch.bfloat16, device, ROOF_COPY_ELEMENTS) if device.type == "cuda" else None
    bar = progress_bar(len(names), "advise", progress)
    for name in names:
        case = M.MODELS[name]
        reason = M.unavailable(case)
        if reason is None:
            try:
                sites_here, timing = _advise_case(case, device, small)
                timing["predicted_ms"] = None if roof is None else timing["bytes_saved"] / roof / 1e6
                sites += sites_here
                timings.append(timing)
            except fusedkit.TracingError as exc:
                skipped[name] = str(exc).split(" (advise")[0]
        else:
            skipped[name] = reason
        bar.update()
    bar.close()
    return sites, timings, skipped


def _advise_case(case, device, small):
    stock, train, _ = M.prepared(case, small, device)
    model, _ = M.variant_model(case, "eager", stock, device)
    x, target = train
    with M.autocast_for(device):
        fused = fusedkit.fuse(copy.deepcopy(model), x)  # (fuse fuses the model it is given, in place)
    found = fused.fusion_sites
    rows = [
        {
            "model": case.name,
            "pattern": s.pattern,
            "module": s.module,
            "bytes_saved": s.bytes_saved,
            "replacement": s.replacement,
        }
        for s in found
    ]
    timing = {"model": case.name, "sites": len(found), "bytes_saved": sum(s.bytes_saved for s in found)}
    # Rounds taking the two models in turn, each time the median over rounds, as the model
    # report times its variants: one timing each read the fused model's ResNet-50 training
    # step as 40% slower than the original's, whose kernels take the same GPU time.
    samples = {key: [] for key in ("original_forward_ms", "fused_forward_ms", "original_train_ms", "fused_train_ms")}
    for _ in range(M.timing_rounds(device)):
        for label, m in (("original", model), ("fused", fused)):
            m.eval()
            with torch.no_grad():
                samples[f"{label}_forward_ms"].append(M.time_ms(lambda m=m: _forward(m, x), device))
            m.train()
            samples[f"{label}_train_ms"].append(M.time_ms(_step(m, case, x, target), device))
    timing.update({key: statistics.median(values) for key, values in samples.items()})
    # The GPU's busy time in a forward: what the bytes saved predict, also where the host
    # bounds the forward's time (ResNet-50's, the GPT-2 MLPs' on the H200).
    for label, m in (("original", model), ("fused", fused)):
        m.eval()
        with torch.no_grad():
            timing[f"{label}_forward_gpu_ms"] = M.gpu_busy_ms(lambda m=m: _forward(m, x), device, GPU_BUSY_CALLS)
        m.train()
    return rows, timing


def _forward(model, x):
    with M.autocast_for(x.device):
        return model(x)


def gpu_saved_ms(timing: dict) -> float | None:
    """The forward's GPU busy time the fused model saves, or None (off a GPU; a record
    written before the busy times were)."""
    original, fused = timing.get("original_forward_gpu_ms"), timing.get("fused_forward_gpu_ms")
    return None if original is None or fused is None else original - fused


def format_advice(sites: list, timings: list, skipped: dict) -> str:
    lines = ["Fusion sites (bytes saved: per forward pass, at the training batch)"]
    head = f"{'model':<14} {'pattern':<22} {'module':<24} {'saved MB':>9}  replacement"
    lines += [head, "-" * len(head)]
    for s in sites:
        lines.append(
            f"{s['model']:<14} {s['pattern']:<22} {s['module'] or '(model)':<24} "
            f"{s['bytes_saved'] / 1e6:>9.3f}  {s['replacement']}"
        )
    lines += [
        "",
        "The fused model against the original (ms: do_bench medians; x = original / fused; predicted: the "
        "forward's bytes saved at the copy bandwidth measured now; saved: the forward's measured saving; "
        "GPU saved: the saving in the forward's GPU busy time, its kernels' durations summed)",
    ]
    head = (
        f"{'model':<14} {'sites':>5} {'saved MB':>9} {'fwd ms':>9} {'fused fwd':>9} {'x':>5} "
        f"{'predicted':>9} {'saved':>9} {'GPU saved':>9} {'train ms':>9} {'fused trn':>9} {'x':>5}"
    )
    lines += [head, "-" * len(head)]
    for t in timings:
        predicted = "-" if t.get("predicted_ms") is None else f"{t['predicted_ms']:.3f}"
        gpu_saved = gpu_saved_ms(t)
        gpu_saved = "-" if gpu_saved is None else f"{gpu_saved:.3f}"
        lines.append(
            f"{t['model']:<14} {t['sites']:>5} {t['bytes_saved'] / 1e6:>9.3f} "
            f"{t['original_forward_ms']:>9.3f} {t['fused_forward_ms']:>9.3f} "
            f"{t['original_forward_ms'] / t['fused_forward_ms']:>5.2f} {predicted:>9} "
            f"{t['original_forward_ms'] - t['fused_forward_ms']:>9.3f} {gpu_saved:>9} "
            f"{t['original_train_ms']:>9.3f} {t['fused_train_ms']:>9.3f} "
            f"{t['original_train_ms'] / t['fused_train_ms']:>5.2f}"
        )
    for name, why in skipped.items():
        lines.append(f"{name:<14} skipped: {why}")
    return "\n".join(lines)


def run_advise_command(args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device)
    if device.type != "cuda":
        print(
            "No CUDA GPU: tiny models in Triton's interpreter; the times check the harness, they are NOT GPU times.\n"
        )
    sites, timings, skipped = run_advice(args.models, device, progress=not args.no_progress)
    print_report(
        env,
        (format_advice(sites, timings, skipped),),
        args.json,
        {"sites": sites, "timings": timings, "skipped": skipped},
    )
    return 0
