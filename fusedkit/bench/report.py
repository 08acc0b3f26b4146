"""The fused-vs-unfused report behind ``python -m fusedkit bench``.

For every registered elementwise kernel it times, on the same operands:
- ``fused``: the fusedkit kernel,
- ``unfused``: the registry's eager PyTorch composition (``torch.relu(torch.add(x, y))``),
- ``compiled``: ``torch.compile`` of that composition (GPU only, one fused kernel),
- ``torch.add``: the single native op, the bandwidth peer every binary op is held to,
and reports modelled bytes (fused and unfused), GB/s and the share of the copy
roof measured in the same run. GPU times are ``triton.testing.do_bench`` medians.
On a CPU the kernels run in Triton's interpreter at small sizes; those times say
nothing about a GPU, and the report says so.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import triton

import fusedkit
from fusedkit import backend_for, elementwise, registry, settings
from fusedkit.runtime.elementwise import INTERPRETED

from .cases import BIAS_COLS, DTYPE_NAMES, LAYOUTS, case_name, make_operands, timer  # noqa: F401 (LAYOUTS: the report's names)
from .peers import supports_tutorial, tutorial
from .progress import bar as progress_bar

GPU_SIZES = (2**20, 2**24, 2**28)
CPU_SIZES = (2**10, 2**12)


@dataclass
class Row:
    kernel: str
    layout: str
    dtype: str
    n: int
    shape: str
    bytes_fused: int
    bytes_unfused: int
    fused_us: float
    unfused_us: float
    torch_add_us: float
    compiled_us: float | None = None
    tutorial_us: float | None = None  # tutorial-style kernel, inputs made contiguous first
    roof_gbps: float | None = None
    fits_l2: bool | None = None
    extra: dict = field(default_factory=dict)

    @property
    def fused_gbps(self) -> float:
        return self.bytes_fused / self.fused_us / 1e3

    @property
    def torch_add_gbps(self) -> float:
        return self.bytes_fused / self.torch_add_us / 1e3 if self.kernel == "add" else math.nan

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            fused_gbps=self.fused_gbps,
            speedup_vs_unfused=self.unfused_us / self.fused_us,
            roof_share=(self.fused_gbps / self.roof_gbps) if self.roof_gbps else None,
        )
        return d


def copy_roof_gbps(dtype, device, n: int) -> float:
    """Bandwidth of ``dst.copy_(src)``, counting bytes read plus written: the roof."""
    src = torch.randn(n, device=device).to(dtype)
    dst = torch.empty_like(src)
    us = timer(device)(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / us / 1e3


def compiled_peer(fn):
    torch._dynamo.reset()  # each case compiles afresh: no recompile limit, no stale guards
    return torch.compile(fn, dynamic=False)


def run(
    kernels, dtypes, sizes, layouts, device, use_compile: bool, progress=True, bias_cols: int = BIAS_COLS
) -> list[Row]:
    time_us = timer(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else None
    # The copy roof means something on a GPU only; the interpreter's copy is a numpy memcpy.
    roofs = {dt: copy_roof_gbps(dt, device, max(sizes)) if device.type == "cuda" else None for dt in dtypes}
    rows = []
    total = sum(dt in k.dtypes for k in kernels for dt in dtypes) * len(sizes) * len(layouts)
    bar = progress_bar(total, "elementwise", progress)
    for spec in kernels:
        for dt in dtypes:
            if dt not in spec.dtypes:
                continue
            for n in sizes:
                for layout in layouts:
                    ops = make_operands(spec, layout, n, dt, device, bias_cols)
                    args = ops + ((spec.param_default,) if spec.param else ())
                    fused = lambda: elementwise(spec, *ops)
                    unfused = lambda: spec.reference(*args)
                    torch_add = lambda: torch.add(ops[0], ops[-1])
                    row = Row(
                        spec.name,
                        layout,
                        str(dt).removeprefix("torch."),
                        n,
                        "x".join(str(s) for s in ops[0].shape),
                        spec.bytes_fused(*ops).total,
                        spec.bytes_unfused(*ops).total,
                        time_us(fused),
                        time_us(unfused),
                        time_us(torch_add),
                        roof_gbps=roofs[dt],
                    )
                    if use_compile:
                        compiled = compiled_peer(spec.reference)
                        row.compiled_us = time_us(lambda: compiled(*args))
                    if supports_tutorial(spec, dt):
                        row.tutorial_us = time_us(lambda: tutorial(spec, ops[0], ops[1], spec.param_default))
                    if l2 is not None:
                        row.fits_l2 = row.bytes_fused <= l2
                    rows.append(row)
                    bar.set_postfix_str(f"{spec.name} {layout} {row.dtype} n={n}")
                    bar.update()
    bar.close()
    return rows


#: (M, N, K) of the matmul report: square, tall, an MLP up-projection, and decode-sized M.
MATMUL_SHAPES = (
    (8192, 8192, 8192),
    (4096, 4096, 4096),
    (16384, 4096, 4096),
    (4096, 11008, 4096),
    (512, 4096, 4096),
    (64, 4096, 4096),
    (16, 4096, 4096),
    (1, 4096, 4096),
)


#: The interpreter's stand-in: small, odd sizes.
CPU_MATMUL_SHAPES = ((64, 48, 40), (7, 33, 65))


def _matmul_kernel(choice: str | None):
    """A block with FUSEDKIT_MATMUL_KERNEL=choice (None: left as it is)."""

    return contextlib.nullcontext() if choice is None else settings.override(matmul_kernel=choice)


def run_matmul(dtypes, device, shapes=MATMUL_SHAPES, progress=True) -> list[dict]:
    """relu(a @ b + bias): fusedkit against cuBLASLt's fused epilogue, eager addmm + relu, and a bare matmul."""
    from fusedkit import matmul_relu

    time_us = timer(device)
    rows = []
    bar = progress_bar(len(dtypes) * len(shapes), "matmul", progress)
    for dt in dtypes:
        for m, n, k in shapes:
            a = torch.randn(m, k, device=device, dtype=dt)
            b = torch.randn(k, n, device=device, dtype=dt)
            bias = torch.randn(n, device=device, dtype=dt)
            flops = 2 * m * n * k
            cases = {
                "fusedkit": lambda: matmul_relu(a, b, bias),  # the kernel FUSEDKIT_MATMUL_KERNEL picks
                "fusedkit_pointer": lambda: matmul_relu(a, b, bias),
                "fusedkit_tma": lambda: matmul_relu(a, b, bias),
                "cublaslt_epilogue": lambda: torch._addmm_activation(bias, a, b),
                "addmm_relu": lambda: torch.relu(torch.addmm(bias, a, b)),
                "matmul_bare": lambda: torch.matmul(a, b),
            }
            row = {"m": m, "n": n, "k": k, "dtype": str(dt).removeprefix("torch.")}
            for name, fn in cases.items():
                with _matmul_kernel(name.removeprefix("fusedkit_") if name.startswith("fusedkit_") else None):
                    us = time_us(fn)
                row[f"{name}_us"] = us
                row[f"{name}_tflops"] = flops / us / 1e6
            rows.append(row)
            bar.set_postfix_str(f"{m}x{n}x{k} {row['dtype']}")
            bar.update()
    bar.close()
    return rows


def format_matmul_table(rows: list[dict]) -> str:
    head = (
        f"{'M':>6} {'N':>6} {'K':>6} {'dtype':<9} {'fusedkit':>9} {'pointer':>8} {'TMA':>8} {'cuBLASLt':>9} "
        f"{'addmm+relu':>10} {'bare mm':>8}  {'x LtEpi':>7} {'x addmm':>7} {'x bare':>7}   "
        f"(TFLOP/s; x = peer time / fusedkit time)"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        f = r["fusedkit_us"]
        lines.append(
            f"{r['m']:>6} {r['n']:>6} {r['k']:>6} {r['dtype']:<9} {r['fusedkit_tflops']:>9.1f} "
            f"{r['fusedkit_pointer_tflops']:>8.1f} {r['fusedkit_tma_tflops']:>8.1f} "
            f"{r['cublaslt_epilogue_tflops']:>9.1f} {r['addmm_relu_tflops']:>10.1f} {r['matmul_bare_tflops']:>8.1f}  "
            f"{r['cublaslt_epilogue_us'] / f:>7.2f} {r['addmm_relu_us'] / f:>7.2f} {r['matmul_bare_us'] / f:>7.2f}"
        )
    return "\n".join(lines)


def _fmt(v, spec="8.1f"):
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_table(rows: list[Row], gpu: bool = True) -> str:
    """The report's table. On a CPU only what means something there: the modelled bytes and
    the saving; the times, labelled, are the interpreter's and PyTorch's CPU kernels'."""
    w = max([len("kernel"), *(len(r.kernel) for r in rows)])  # the kernel column fits the longest name
    if not gpu:
        head = (
            f"{'kernel':<{w}} {'layout':<10} {'dtype':<8} {'n':>8} {'MB fused':>9} {'MB unfused':>10} "
            f"{'saved':>6} {'interp us':>10} {'torch CPU us':>12}"
        )
        lines = [head, "-" * len(head)]
        for r in rows:
            lines.append(
                f"{r.kernel:<{w}} {r.layout:<10} {r.dtype:<8} {r.n:>8} {r.bytes_fused / 1e6:>9.3f} "
                f"{r.bytes_unfused / 1e6:>10.3f} {1 - r.bytes_fused / r.bytes_unfused:>6.0%} "
                f"{r.fused_us:>10.0f} {r.unfused_us:>12.0f}"
            )
        return "\n".join(lines)
    head = (
        f"{'kernel':<{w}} {'layout':<10} {'dtype':<8} {'n':>10} {'MB fused':>9} {'MB unfus':>9} "
        f"{'fused us':>9} {'unfus us':>9} {'compl us':>9} {'tutor us':>9} {'add us':>9} {'GB/s':>7} "
        f"{'roof':>5} {'x unfus':>7} {'x compl':>7} {'x tutor':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        share = f"{100 * r.fused_gbps / r.roof_gbps:4.0f}%" if r.roof_gbps else "  -"
        vs_compiled = r.compiled_us / r.fused_us if r.compiled_us else None
        vs_tutorial = r.tutorial_us / r.fused_us if r.tutorial_us else None
        lines.append(
            f"{r.kernel:<{w}} {r.layout:<10} {r.dtype:<8} {r.n:>10} {r.bytes_fused / 1e6:>9.2f} "
            f"{r.bytes_unfused / 1e6:>9.2f} {_fmt(r.fused_us, '9.1f')} {_fmt(r.unfused_us, '9.1f')} "
            f"{_fmt(r.compiled_us, '9.1f')} {_fmt(r.tutorial_us, '9.1f')} {_fmt(r.torch_add_us, '9.1f')} "
            f"{r.fused_gbps:>7.0f} {share:>5} {r.unfused_us / r.fused_us:>7.2f} {_fmt(vs_compiled, '7.2f')} "
            f"{_fmt(vs_tutorial, '7.2f')}"
        )
    return "\n".join(lines)


def _commit() -> str | None:
    """``FUSEDKIT_COMMIT`` when set (a copied tree whose ``.git``, if any, is not its own);
    else the checkout's commit (``+dirty`` with uncommitted changes), when fusedkit runs from one."""
    import subprocess

    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )  # fusedkit/bench/ -> the checkout
    if os.environ.get("FUSEDKIT_COMMIT") or not os.path.isdir(os.path.join(root, ".git")):
        return os.environ.get("FUSEDKIT_COMMIT")
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def environment(device) -> dict:

    env = {
        "fusedkit": fusedkit.__version__,
        "commit": _commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "device": str(device),
        "backend": backend_for(device),
        "native_launch": settings.current().native_launch,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    from fusedkit.runtime.matmul import fp32_precision

    env["fp32_matmul"] = fp32_precision()  # "tf32" (both sides) where PyTorch allows it, else fusedkit's mode
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sms=props.multi_processor_count, l2_bytes=props.L2_cache_size)
        try:
            import subprocess

            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def run_ncu(rows, kernels, dtypes, sizes, layouts, device, env) -> list[dict] | None:
    """Counters beside the model for every case; None (with a note) where ncu cannot run."""
    from . import ncu

    if device.type != "cuda" or not ncu.ncu_available():
        print("\n--ncu: Nsight Compute needs a CUDA GPU and `ncu` on PATH; measured traffic skipped.")
        return None
    dtype_arg = ",".join(next(k for k, v in DTYPE_NAMES.items() if v == d) for d in dtypes)

    def measure(ns, cache_control):
        return ncu.measure(
            [",".join(k.name for k in kernels), dtype_arg, ",".join(str(n) for n in ns), ",".join(layouts)],
            cache_control=cache_control,
        )

    l2 = env.get("l2_bytes") or 0
    models = {}
    for r in rows:
        spec = registry.get(r.kernel)
        ops = make_operands(spec, r.layout, r.n, DTYPE_NAMES[_short(r.dtype)], "meta")
        models[id(r)] = spec.bytes_fused(*ops), spec.bytes_unfused(*ops)
    cold = measure(sizes, ncu.CACHE_COLD)
    # Sizes with a case that fits in L2 also run warm: cold caches would hide the L2 saving.
    small = sorted({r.n for r in rows if models[id(r)][0].total <= l2})
    warm = measure(small, ncu.CACHE_WARM) if small else {}
    out = []
    for r in rows:
        name = case_name(r.kernel, r.layout, r.dtype, r.n)
        fused, unfused = cold.get(f"{name}|fused"), cold.get(f"{name}|unfused")
        if fused is None or unfused is None:
            continue
        model_f, model_u = models[id(r)]
        fits = model_f.total <= l2
        warm_f, warm_u = warm.get(f"{name}|fused"), warm.get(f"{name}|unfused")
        cold_verdict = ncu.verdict(model_f, model_u, fused, unfused, fits)
        row = dict(
            case=name,
            model_fused_read=model_f.read,
            model_fused_written=model_f.written,
            model_unfused_total=model_u.total,
            ncu_fused_read=fused.read,
            ncu_fused_written=fused.written,
            ncu_unfused_read=unfused.read,
            ncu_unfused_written=unfused.written,
            fused_kernels=len(fused.kernels),
            unfused_kernels=len(unfused.kernels),
            fits_l2=fits,
            verdict_cold=cold_verdict,
            verdict=cold_verdict,
        )
        if fits and warm_f is not None and warm_u is not None:
            row.update(
                ncu_warm_fused_total=warm_f.read + warm_f.written,
                ncu_warm_unfused_total=warm_u.read + warm_u.written,
                verdict=ncu.warm_verdict(model_f, model_u, warm_f, warm_u),
            )
        out.append(row)
    print(f"\nDRAM bytes, Nsight Compute (--clock-control none --cache-control {ncu.CACHE_COLD}) beside the model, MB:")
    print(f"{'case':<36} {'model rd':>9} {'ncu rd':>9} {'ncu wr':>9} {'unf model':>9} {'unf ncu':>9}  verdict")
    for t in out:
        print(
            f"{t['case']:<36} {t['model_fused_read'] / 1e6:>9.2f} {t['ncu_fused_read'] / 1e6:>9.2f} "
            f"{t['ncu_fused_written'] / 1e6:>9.2f} {t['model_unfused_total'] / 1e6:>9.2f} "
            f"{(t['ncu_unfused_read'] + t['ncu_unfused_written']) / 1e6:>9.2f}  {t['verdict_cold']}"
        )
    warm_rows = [t for t in out if "ncu_warm_fused_total" in t]
    if warm_rows:
        print(
            f"\nThe cases that fit in L2 again, --cache-control {ncu.CACHE_WARM} (inputs warm from the "
            "warm-up launches), MB moved to or from DRAM:"
        )
        print(f"{'case':<36} {'model':>9} {'ncu warm':>9} {'unf model':>9} {'unf warm':>9}  verdict")
        for t in warm_rows:
            print(
                f"{t['case']:<36} {(t['model_fused_read'] + t['model_fused_written']) / 1e6:>9.3f} "
                f"{t['ncu_warm_fused_total'] / 1e6:>9.3f} {t['model_unfused_total'] / 1e6:>9.3f} "
                f"{t['ncu_warm_unfused_total'] / 1e6:>9.3f}  {t['verdict']}"
            )
    return out


def _short(dtype_name: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}[dtype_name]


def print_report(env: dict, tables, json_path: str | None, payload: dict) -> None:
    """Print the environment line and the tables (a blank line between), and save
    ``payload`` with the environment as JSON when asked."""
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print("\n\n".join(tables))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": env, **payload}, f, indent=1)


def _write_rows(args, env, rows, traffic) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": [r.as_dict() for r in rows], "ncu": traffic}, f, indent=1)
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            dicts = [r.as_dict() for r in rows]
            writer = csv.DictWriter(f, fieldnames=[k for k in dicts[0] if k != "extra"], extrasaction="ignore")
            writer.writeheader()
            writer.writerows(dicts)


def _child_flags(args) -> list[str]:
    """The flags a report's ``--processes`` children take from the parent's arguments."""
    return [flag for flag, on in (("--no-compile", args.no_compile), ("--tf32", args.tf32)) if on]


def run_command(args) -> int:
    """``python -m fusedkit bench`` with its parsed (and validated) arguments."""
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    gpu = device.type == "cuda"
    kernels = [registry.get(k) for k in args.kernels]
    dtypes = [DTYPE_NAMES[d] for d in args.dtypes]
    sizes = args.sizes or list(GPU_SIZES if gpu else CPU_SIZES)
    use_compile = gpu and not args.no_compile
    progress = not args.no_progress
    if args.pin:  # (every thread so far; those started later inherit it, autograd's device threads too)
        core = max(os.sched_getaffinity(0))
        for thread in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
            with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
                os.sched_setaffinity(int(thread), {core})
    env = environment(device)
    if args.pin:
        env["pinned_core"] = core
    if not gpu:
        where = "Triton's interpreter" if INTERPRETED else "PyTorch"
        print(
            f"No CUDA GPU: the kernels run in {where} on the CPU. These times check the harness; "
            "they are NOT GPU times.\n"
        )

    if args.backward:
        from . import backward as bb

        default = bb.BACKWARD_SIZES if gpu else bb.CPU_BACKWARD_SIZES
        brows = bb.run_backward(dtypes, device, args.sizes or default, use_compile=use_compile)
        lrows = bb.run_linear_training(
            dtypes, device, bb.LINEAR_TRAINING_SHAPES if gpu else bb.CPU_LINEAR_TRAINING_SHAPES
        )
        print_report(
            env,
            (bb.format_backward_table(brows), bb.format_linear_table(lrows)),
            args.json,
            {"backward": brows, "linear_relu_training": lrows},
        )
        return 0
    if args.norms:
        from .norms import CPU_NORM_SHAPES, NORM_SHAPES, format_norms_table, run_norms

        rows = run_norms(dtypes, device, NORM_SHAPES if gpu else CPU_NORM_SHAPES, use_compile=use_compile)
        print_report(env, (format_norms_table(rows),), args.json, {"norms": rows})
        return 0
    if args.traffic:
        from .ncu import ncu_available
        from .traffic import format_traffic, run_traffic

        if not gpu or not ncu_available():
            print("--traffic needs a CUDA GPU and Nsight Compute's ncu on PATH")
            return 1
        results = run_traffic()
        print_report(env, (format_traffic(results),), args.json, {"traffic": results})
        return 0
    if args.models:
        from .models import add_processes, format_models_table, run_models, run_processes

        if args.processes > 1:  # the same report in that many processes, one after another
            child = ["--models", ",".join(args.models)]
            child += _child_flags(args)
            rows, skipped, runs = run_processes(child, args.processes, progress)
        else:
            results, skipped = run_models(args.models, device, use_compile=use_compile, progress=progress)
            rows = [vars(r) for r in results]
            runs = [rows]
        payload = {"models": rows, "skipped": skipped, "processes": runs}
        if args.add:
            payload = add_processes(args.json, env, payload)
            rows, skipped = payload["models"], payload["skipped"]
        print_report(env, (format_models_table(rows, skipped),), args.json, payload)
        return 0
    if args.latency:
        from .host import HOST_MATMULS, HOST_ROWS, HOST_SIZES
        from .latency import LATENCY_SIZES, LINEAR_SHAPES, NORM_SHAPES, format_latency_table, merge_latency, run_latency
        from .processes import run_children

        if args.processes > 1:  # the same report in that many processes, one after another
            child = ["--latency", "--dtypes", ",".join(args.dtypes)]
            # (as the children parse them: a number below 64 is an exponent there)
            child += (
                ["--sizes", ",".join(f"2**{n.bit_length() - 1}" if n < 64 else str(n) for n in args.sizes)]
                if args.sizes
                else []
            )
            child += _child_flags(args)
            payloads, failed = run_children(child, args.processes, "latency", progress)
            if not payloads:
                print(f"--processes {args.processes}: no process finished ({failed})")
                return 1
            result = {**merge_latency(payloads), **({"skipped": failed} if failed else {})}
            if failed:  # (the others' medians are reported, and the report fails)
                print(f"--processes {args.processes}: {len(payloads)} finished; did not: {failed}")
                print_report(env, (format_latency_table(result),), args.json, result)
                return 1
        else:
            result = run_latency(
                dtypes,
                device,
                args.sizes or (LATENCY_SIZES if gpu else CPU_SIZES),
                LINEAR_SHAPES if gpu else ((1, 64),),
                use_compile=use_compile,
                progress=progress,
                norm_shapes=NORM_SHAPES if gpu else ((2, 64),),
                host_grid=(HOST_SIZES, HOST_ROWS, HOST_MATMULS) if gpu else ((1 << 10,), ((2, 64),), ((1, 64),)),
            )
        print_report(env, (format_latency_table(result),), args.json, result)
        return 0
    if args.matmul:
        shapes = args.shapes or (MATMUL_SHAPES if gpu else CPU_MATMUL_SHAPES)
        mrows = run_matmul(dtypes, device, shapes, progress=progress)
        print_report(env, (format_matmul_table(mrows),), args.json, {"matmul": mrows})
        if args.plots:
            from .plots import plot_matmul

            print("wrote", plot_matmul(mrows, env, args.plots))
        return 0
    rows = run(kernels, dtypes, sizes, args.layouts, device, use_compile, progress=progress, bias_cols=args.bias_cols)
    _write_rows(args, env, rows, None)  # the numbers are safe before anything else runs
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    if gpu:
        print(
            "MB: modelled DRAM bytes (read + written). GB/s: fused bytes / fused time. roof: share of the copy "
            "bandwidth measured now. tutor: a tutorial-style Triton kernel, non-contiguous inputs copied "
            "first. x unfus / x compl / x tutor: time of the peer / time of fusedkit."
        )
    else:
        print(
            "MB: modelled DRAM bytes (read + written); saved: what fusing saves. interp us: fusedkit in "
            "Triton's interpreter; torch CPU us: the unfused ops on the CPU. Neither is a GPU time."
        )
    print(format_table(rows, gpu))
    if args.ncu:
        traffic = run_ncu(rows, kernels, dtypes, sizes, args.layouts, device, env)
        _write_rows(args, env, rows, traffic)
    if args.plots:
        from .plots import plot_elementwise

        traffic = None
        if args.json:
            with open(args.json) as f:
                traffic = json.load(f).get("ncu")
        for path in plot_elementwise([r.as_dict() for r in rows], env, args.plots, traffic):
            print("wrote", path)
    return 0
