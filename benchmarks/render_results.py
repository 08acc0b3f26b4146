"""Render the committed results of one GPU into the docs' tables.

    python benchmarks/render_results.py benchmarks/results/h200

reads the reports' JSON files that ``bash scripts/results.sh`` wrote there and rewrites
the regions between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` in
``docs/results.md`` and ``README.md``: one table per report and the README's headline
rows, each with one footnote naming the GPU, the versions, the commit and the date.
A report whose JSON is missing leaves its region as it is.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = (ROOT / "docs" / "results.md", ROOT / "docs" / "fuse.md", ROOT / "README.md")
SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


def load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def footnote(env: dict, command: str) -> str:
    # a record gathered over several device leases (--add) names every commit it holds
    commit = ", ".join(c[:12] for c in env.get("commits") or [env.get("commit") or "unknown"])
    gpu = env.get("gpu") or f"{env.get('device')} ({env.get('backend')}: not GPU times)"
    driver = f", driver {env['driver']}" if env.get("driver") else ""
    return (
        f"<sub>{gpu}{driver}; torch {env.get('torch')}, triton {env.get('triton')}; fusedkit "
        f"{env.get('fusedkit', '?')} at {commit}; {env.get('date', '')[:10]}. Reproduce: "
        f"`bash scripts/results.sh {command}`.</sub>"
    )


def ratio(peer, ours) -> str:
    return f"{peer / ours:.2f}x" if peer and ours else "-"


def table(head: list[str], rows: list[list], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(head) - 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def elementwise(data: dict) -> str:
    rows = data["rows"]
    n = max(r["n"] for r in rows)
    body = []
    for r in rows:
        if r["n"] != n:
            continue
        share = f"{r['roof_share']:.0%}" if r.get("roof_share") else "-"
        body.append(
            [
                r["kernel"],
                r["layout"],
                SHORT.get(r["dtype"], r["dtype"]),
                f"{r['fused_us']:.1f}",
                f"{r['fused_gbps']:.0f}",
                share,
                ratio(r["unfused_us"], r["fused_us"]),
                ratio(r.get("compiled_us"), r["fused_us"]),
                ratio(r.get("tutorial_us"), r["fused_us"]),
            ]
        )
    head = [
        "kernel",
        "layout",
        "dtype",
        "fusedkit us",
        "GB/s",
        "copy roof",
        "x eager",
        "x torch.compile",
        "x tutorial kernel",
    ]
    sizes = sorted({r["n"] for r in rows})
    small = [r for r in rows if r["n"] != n and r["layout"] == "contiguous" and r["kernel"] == "add_relu"]
    text = f"n = 2^{n.bit_length() - 1} elements:\n\n" + table(head, body, "lllrrrrrr")
    if small:
        text += (
            "\n\nadd_relu, contiguous, at the other sizes ("
            + ", ".join(f"2^{s.bit_length() - 1}" for s in sizes if s != n)
            + "):\n\n"
        )
        text += table(
            ["n", "dtype", "fusedkit us", "GB/s", "x eager", "x torch.compile"],
            [
                [
                    f"2^{r['n'].bit_length() - 1}",
                    SHORT.get(r["dtype"], r["dtype"]),
                    f"{r['fused_us']:.1f}",
                    f"{r['fused_gbps']:.0f}",
                    ratio(r["unfused_us"], r["fused_us"]),
                    ratio(r.get("compiled_us"), r["fused_us"]),
                ]
                for r in small
            ],
        )
    return text + "\n\n" + footnote(data["environment"], "elementwise")


def ncu(data: dict) -> str:
    rows = data.get("ncu") or []
    body = [
        [
            t["case"],
            f"{t['model_fused_read'] / 1e6:.2f}",
            f"{t['ncu_fused_read'] / 1e6:.2f}",
            f"{t['model_fused_written'] / 1e6:.2f}",
            f"{t['ncu_fused_written'] / 1e6:.2f}",
            f"{t['model_unfused_total'] / 1e6:.2f}",
            f"{(t['ncu_unfused_read'] + t['ncu_unfused_written']) / 1e6:.2f}",
            t["verdict"],
        ]
        for t in rows
    ]
    head = [
        "case",
        "model read MB",
        "ncu read MB",
        "model written MB",
        "ncu written MB",
        "unfused model MB",
        "unfused ncu MB",
        "verdict",
    ]
    return table(head, body, "lrrrrrrl") + "\n\n" + footnote(data["environment"], "ncu")


def traffic(data: dict) -> str:
    """Per case: how many ops above the floor agree, the step's totals, and each op that differs."""
    body, differs = [], []
    for case, rows in (data.get("traffic") or {}).items():
        judged = [r for r in rows if r.get("agrees") is not None]
        body.append(
            [
                case,
                len(rows),
                len(judged),
                sum(r["agrees"] for r in judged),
                f"{sum(r['read'] for r in rows) / 1e6:.1f}",
                f"{sum(r.get('dram_read') or 0 for r in rows) / 1e6:.1f}",
            ]
        )
        differs += [
            [
                case,
                f"`{r['op']}`",
                f"{r['read'] / 1e6:.2f}",
                "no kernel measured" if r.get("dram_read") is None else f"{r['dram_read'] / 1e6:.2f}",
                "-" if r.get("error") is None else f"{100 * r['error']:+.1f}%",
            ]
            for r in judged
            if not r["agrees"]
        ]
    out = table(["case", "ops", "ops reading over 1 MB", "reads within 10%", "model read MB", "DRAM read MB"], body)
    if differs:
        out += "\n\nThe ops whose reads differ by more than 10%:\n\n" + table(
            ["case", "op", "model read MB", "DRAM read MB", "error"], differs, "llrrr"
        )
    return out + "\n\n" + footnote(data["environment"], "traffic")


def gpu_saved(timing: dict) -> str:
    """The forward's GPU busy ms the fused model saves ("-" in a record without busy times)."""
    original, fused = timing.get("original_forward_gpu_ms"), timing.get("fused_forward_gpu_ms")
    return "-" if original is None or fused is None else f"{original - fused:.3f}"


def advise(data: dict) -> str:
    """Per model: the sites found by pattern, bytes saved, and the fused model's times against
    the original's, with the forward's saving predicted from its bytes."""
    patterns: dict[str, dict[str, int]] = {}
    for site in data.get("sites") or []:
        counts = patterns.setdefault(site["model"], {})
        counts[site["pattern"]] = counts.get(site["pattern"], 0) + 1
    body = []
    for t in data.get("timings") or []:
        found = ", ".join(f"{n} x `{p}`" for p, n in sorted(patterns.get(t["model"], {}).items()))
        predicted = "-" if t.get("predicted_ms") is None else f"{t['predicted_ms']:.3f}"
        body.append(
            [
                f"`{t['model']}`",
                found or "none",
                f"{t['bytes_saved'] / 1e6:.1f}",
                f"{t['original_forward_ms']:.3f}",
                f"{t['fused_forward_ms']:.3f}",
                ratio(t["original_forward_ms"], t["fused_forward_ms"]),
                predicted,
                f"{t['original_forward_ms'] - t['fused_forward_ms']:.3f}",
                gpu_saved(t),
                ratio(t["original_train_ms"], t["fused_train_ms"]),
            ]
        )
    head = [
        "model",
        "sites",
        "saved MB a forward",
        "forward ms",
        "fused forward ms",
        "x",
        "predicted ms saved",
        "measured ms saved",
        "GPU busy ms saved",
        "train step x",
    ]
    text = table(head, body, "llrrrrrrrr")
    for name, why in (data.get("skipped") or {}).items():
        # (the reason's first sentence: torch.fx's messages go on with general advice)
        text += f"\n\n`{name}` was not traced: {why.split('. ')[0].rstrip('.')}."
    return text + "\n\n" + footnote(data["environment"], "advise")


def matmul(data: dict) -> str:
    body = [
        [
            f"{r['m']} x {r['n']} x {r['k']}",
            SHORT.get(r["dtype"], r["dtype"]),
            f"{r['fusedkit_tflops']:.1f}",
            f"{r['cublaslt_epilogue_tflops']:.1f}",
            f"{r['addmm_relu_tflops']:.1f}",
            f"{r['matmul_bare_tflops']:.1f}",
            ratio(r["cublaslt_epilogue_us"], r["fusedkit_us"]),
            ratio(r["addmm_relu_us"], r["fusedkit_us"]),
            ratio(r["matmul_bare_us"], r["fusedkit_us"]),
        ]
        for r in data["matmul"]
    ]
    head = [
        "M x N x K",
        "dtype",
        "fusedkit TFLOP/s",
        "cuBLASLt epilogue",
        "addmm + relu",
        "bare matmul",
        "x cuBLASLt",
        "x addmm + relu",
        "x bare",
    ]
    return table(head, body, "llrrrrrrr") + "\n\n" + footnote(data["environment"], "matmul")


def latency(data: dict) -> str:
    body = []
    for r in data["elementwise"]:
        fb, tb = r.get("fusedkit.add_relu fwd+bwd"), r.get("relu(x + y) fwd+bwd")
        body.append(
            [
                SHORT.get(r["dtype"], r["dtype"]),
                r["n"],
                f"{r['torch.add']:.1f}",
                f"{r['relu(x + y)']:.1f}",
                f"{r['fusedkit.add_relu']:.1f}",
                f"{r['fusedkit.add_relu'] / r['torch.add']:.2f}",
                "-" if tb is None else f"{tb:.1f}",
                "-" if fb is None else f"{fb:.1f}",
                "-" if fb is None else f"{fb / tb:.2f}",
                f"{r.get('graph fusedkit.add_relu') or 0:.1f}",
            ]
        )
    head = [
        "dtype",
        "n",
        "torch.add us",
        "relu(x + y) us",
        "fusedkit.add_relu us",
        "/ torch.add",
        "relu(x + y) fwd + bwd us",
        "add_relu fwd + bwd us",
        "/ relu(x + y)",
        "add_relu in a CUDA graph",
    ]
    text = table(head, body, "lrrrrrrrrr")
    lin = data.get("linear") or []
    if lin:
        text += "\n\n" + table(
            [
                "dtype",
                "M",
                "K = N",
                "fusedkit.linear_relu us",
                "relu(F.linear) us",
                "ratio",
                "fwd + bwd us",
                "torch fwd + bwd us",
                "ratio",
            ],
            [
                [
                    SHORT.get(r["dtype"], r["dtype"]),
                    r["m"],
                    r["k"],
                    f"{r['fusedkit.linear_relu']:.1f}",
                    f"{r['relu(F.linear)']:.1f}",
                    f"{r['fusedkit.linear_relu'] / r['relu(F.linear)']:.2f}",
                    f"{r.get('fusedkit.linear_relu fwd+bwd') or 0:.1f}",
                    f"{r.get('relu(F.linear) fwd+bwd') or 0:.1f}",
                    f"{(r.get('fusedkit.linear_relu fwd+bwd') or 0) / (r.get('relu(F.linear) fwd+bwd') or 1):.2f}",
                ]
                for r in lin
            ],
            "lrrrrrrrr",
        )
    norms = data.get("norms") or []
    if norms:
        text += "\n\n" + table(
            [
                "dtype",
                "rows",
                "n",
                "op",
                "fusedkit us",
                "eager us",
                "ratio",
                "fwd + bwd us",
                "eager fwd + bwd us",
                "ratio",
            ],
            [
                [
                    SHORT.get(r["dtype"], r["dtype"]),
                    r["rows"],
                    r["n"],
                    f"`{r['op']}`",
                    f"{r['fusedkit']:.1f}",
                    f"{r['eager']:.1f}",
                    f"{r['fusedkit'] / r['eager']:.2f}",
                    f"{r['fusedkit fwd+bwd']:.1f}",
                    f"{r['eager fwd+bwd']:.1f}",
                    f"{r['fusedkit fwd+bwd'] / r['eager fwd+bwd']:.2f}",
                ]
                for r in norms
            ],
            "lrrlrrrrrr",
        )
    host = data.get("host") or []
    if host:
        text += "\n\n" + host_table(host, data.get("host dtype", ""), data.get("processes", 1))
    return text + "\n\n" + footnote(data["environment"], "latency")


def host_table(rows: list[dict], dtype: str, processes: int) -> str:
    """The host time of every public op, a row per op and mode, a column per size: fusedkit's
    host time over eager's (below 1.00: fusedkit issues faster), then fusedkit's µs."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    cells = {(r["op"], r["mode"], r["shape"]): r for r in rows}
    body = []
    for op, mode in dict.fromkeys((r["op"], r["mode"]) for r in rows):
        line = [f"`{op}`", mode]
        for shape in shapes:
            r = cells.get((op, mode, shape))
            line.append("" if r is None else f"{r['fusedkit host'] / r['eager host']:.2f} ({r['fusedkit host']:.1f})")
        body.append(line)
    ratios = [r["fusedkit host"] / r["eager host"] for r in rows]
    where = f", median of {processes} processes" if processes > 1 else ""
    head = (
        f"Host time a call ({SHORT.get(dtype, dtype)}), the GPU idle before each call{where}: fusedkit / eager "
        f"(fusedkit's µs). {sum(x <= 1.0 for x in ratios)} of {len(ratios)} at or below 1.00."
    )
    return head + "\n\n" + table(["op", "mode", *shapes], body, "ll" + "r" * len(shapes))


def backward(data: dict) -> str:
    head = [
        "dtype",
        "n",
        "backward us",
        "eager backward us",
        "x eager",
        "fwd + bwd us",
        "eager fwd + bwd us",
        "x eager",
        "saved MiB",
        "eager saved MiB",
    ]
    parts = []
    for op in dict.fromkeys(r.get("op", "add_relu") for r in data["backward"]):
        body = []
        for r in (r for r in data["backward"] if r.get("op", "add_relu") == op):
            body.append(
                [
                    SHORT.get(r["dtype"], r["dtype"]),
                    f"2^{r['n'].bit_length() - 1}",
                    f"{r['fusedkit_bwd_us']:.1f}",
                    f"{r['eager_bwd_us']:.1f}",
                    ratio(r["eager_bwd_us"], r["fusedkit_bwd_us"]),
                    f"{r['fusedkit_fwd_bwd_us']:.1f}",
                    f"{r['eager_fwd_bwd_us']:.1f}",
                    ratio(r["eager_fwd_bwd_us"], r["fusedkit_fwd_bwd_us"]),
                    f"{r['fusedkit_saved_bytes'] / 2**20:.0f}",
                    f"{r['eager_saved_bytes'] / 2**20:.0f}",
                ]
            )
        parts.append(f"{op}:\n\n" + table(head, body, "llrrrrrrrr"))
    text = "\n\n".join(parts)
    lin = data.get("linear_relu_training") or []
    if lin:
        text += "\n\nLinearReLU forward + backward against nn.Linear + nn.ReLU:\n\n" + table(
            ["dtype", "M x K x N", "fusedkit us", "torch us", "x torch"],
            [
                [
                    SHORT.get(r["dtype"], r["dtype"]),
                    f"{r['m']} x {r['k']} x {r['n']}",
                    f"{r['fusedkit_us']:.1f}",
                    f"{r['torch_us']:.1f}",
                    ratio(r["torch_us"], r["fusedkit_us"]),
                ]
                for r in lin
            ],
            "llrrr",
        )
    return text + "\n\n" + footnote(data["environment"], "backward")


def norms(data: dict) -> str:
    """The norm family: fusedkit's forward and backward against the copy roof; forward +
    backward against eager, compiled torch and Liger-Kernel, GPU busy time (kernels summed;
    ratios: their time over fusedkit's) and the wall time of eager launches."""
    rows = data["norms"]
    gpu = "_fwd_bwd_gpu_us" if any("fusedkit_fwd_bwd_gpu_us" in r for r in rows) else "_fwd_bwd_us"
    peers = [p for p in ("eager", "compiled", "liger") if any(f"{p}{gpu}" in r for r in rows)]
    head = ["op", "dtype", "rows x n", "fwd us", "of copy roof", "bwd us", "of copy roof", "fwd + bwd GPU us"]
    head += [f"x {p}" for p in peers] + ["fwd + bwd wall us", "eager wall us"]

    def us(v):
        return f"{v:.1f}" if v else "-"

    def share(v):
        return "-" if v is None else f"{v:.0%}"

    body = []
    for r in rows:
        mine = r.get(f"fusedkit{gpu}")
        body.append(
            [
                f"`{r['op']}`",
                SHORT.get(r["dtype"], r["dtype"]),
                f"{r['rows']} x {r['n']}",
                us(r.get("fusedkit_fwd_gpu_us") or r.get("fusedkit_fwd_us")),
                share(r.get("fusedkit_roof_share")),
                us(r.get("fusedkit_bwd_us")),
                share(r.get("fusedkit_bwd_roof_share")),
                us(mine),
                *(ratio(r.get(f"{p}{gpu}"), mine) for p in peers),
                us(r.get("fusedkit_fwd_bwd_us")),
                us(r.get("eager_fwd_bwd_us")),
            ]
        )
    return table(head, body, "lll" + "r" * (len(head) - 3)) + "\n\n" + footnote(data["environment"], "norms")


def _by_model(rows: list[dict]) -> dict[str, dict]:
    """``{model: {variant: row}}``, in the rows' order."""
    by_model: dict[str, dict] = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[r["variant"]] = r
    return by_model


def models(data: dict) -> str:
    """One row per model and variant; ratios against stock eager in the same run."""
    by_model = _by_model(data["models"])

    def ms(v):
        return "-" if v is None else f"{v:.2f}"

    body = []
    for model, rows in by_model.items():
        base = rows["eager"]
        for variant, r in rows.items():
            if variant == "eager2":
                continue
            body.append(
                [
                    f"`{model}`",
                    variant,
                    ms(r["train_ms"]),
                    ratio(base["train_ms"], r["train_ms"]),
                    ms(r["gpu_ms"]),
                    ms(r.get("host_ms")),
                    f"{r['bs1_ms'] * 1e3:.0f}",
                    ratio(base["bs1_ms"], r["bs1_ms"]),
                    f"{r['serve_ms'] * 1e3:.0f}",
                    ratio(base["serve_ms"], r["serve_ms"]),
                    "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}",
                    f"{r['max_loss_rel_diff']:.1e}",
                    f"{rows['eager2']['max_loss_rel_diff']:.1e}" if "eager2" in rows else "-",
                ]
            )
    head = [
        "model",
        "variant",
        "train step ms",
        "x eager",
        "GPU busy ms",
        "host ms",
        "batch-1 us",
        "x eager",
        "serving us",
        "x eager",
        "peak MiB",
        "loss diff",
        "control",
    ]
    text = table(head, body, "llrrrrrrrrrrr")
    for name, reason in (data.get("skipped") or {}).items():
        text += f"\n\n`{name}` did not run: {reason}."
    return text + "\n\n" + footnote(data["environment"], "models")


def whole(data: dict) -> str:
    """Whole models through ``fusedkit.fuse``: medians over processes, the training step's range."""
    by_model = _by_model(data["models"])

    def ms(v, scale=1.0, spec=".2f"):
        return "-" if v is None else format(v * scale, spec)

    body = []
    for model, rows in by_model.items():
        base = rows["eager"]
        for variant, r in rows.items():
            if variant == "eager2":
                continue
            span = r.get("train_x_range")
            compiled = rows.get("compiled") if variant == "fusedkit_compiled" else None
            body.append(
                [
                    f"`{model}`",
                    variant,
                    "-" if r.get("sites") is None else r["sites"],
                    ms(r["train_ms"]),
                    ratio(base["train_ms"], r["train_ms"]),
                    "-" if not span else f"{span[0]:.2f}-{span[1]:.2f}",
                    ratio(compiled["train_ms"], r["train_ms"]) if compiled else "-",
                    ms(r.get("gpu_ms")),
                    ms(r.get("host_ms")),
                    ms(r["serve_ms"]),
                    ratio(base["serve_ms"], r["serve_ms"]),
                    ms(r.get("decode1_ms")) + ("*" if r.get("decode_equal") is False else ""),
                    ratio(base.get("decode1_ms"), r.get("decode1_ms")),
                    ms(r.get("decode16_ms")) + ("*" if r.get("decode_equal") is False else ""),
                    ratio(base.get("decode16_ms"), r.get("decode16_ms")),
                    "-" if r.get("decode_agree") is None else str(r["decode_agree"]),
                    ms(r["peak_mb"], 1, ".0f"),
                    f"{r['max_loss_rel_diff']:.1e}",
                    f"{rows['eager2']['max_loss_rel_diff']:.1e}" if "eager2" in rows else "-",
                ]
            )
    head = [
        "model",
        "variant",
        "sites",
        "train step ms",
        "x eager",
        "x range",
        "x compiled",
        "GPU busy ms",
        "host ms",
        "prefill ms",
        "x eager",
        "decode ms/token, batch 1",
        "x eager",
        "batch 16",
        "x eager",
        "tokens agree",
        "peak MiB",
        "loss diff",
        "control",
    ]
    text = table(head, body, "llrrrrrrrrrrrrrrrrr")
    if any(r.get("decode_equal") is False for r in data["models"]):
        text += "\n\n\\* its greedy tokens differ from stock eager's (from the same weights)."
    if any(r.get("decode_agree") is not None for r in data["models"]):
        text += (
            "\n\nTokens agree: the new tokens equal to stock eager's before the first that differs (the least over "
            "processes)."
        )
    for name, reason in (data.get("skipped") or {}).items():
        text += f"\n\n`{name}` did not run: {reason}."
    processes = max((r.get("processes", 1) for r in data["models"]), default=1)
    return text + "\n\n" + footnote(data["environment"], "whole") + f" <sub>Medians over {processes} processes.</sub>"


def _find(rows: list[dict], **want) -> dict | None:
    """The first row whose fields have the wanted values."""
    return next((r for r in rows if all(r.get(k) == v for k, v in want.items())), None)


def headline(reports: dict) -> str | None:
    """At most eight rows for the README: one ratio each, the peer named."""
    rows, envs, shown = [], [], set()
    for report, model, label in (
        ("whole", "resnet50", "torchvision ResNet-50 training step, `fusedkit.fuse(model)`"),
        ("whole", "llama_1b", "1B LLaMA (transformers) training step, `fusedkit.fuse(model)`"),
        # (a result set from before the whole-model report: its ResNet-50 fused by hand)
        ("models", "resnet50", "torchvision ResNet-50 training step, joins through `add_relu`"),
        ("models", "gpt2_mlp", "GPT-2 medium MLP training step, GELU in the matmul epilogue"),
    ):
        md = reports.get(report)
        if md and model not in shown:
            if md["environment"] not in envs:
                envs.append(md["environment"])
            r = _find(md["models"], model=model, variant="fusedkit")
            e = _find(md["models"], model=model, variant="eager")
            if r and e:
                shown.add(model)
                rows.append(
                    [
                        label,
                        "the stock model, eager",
                        ratio(e["train_ms"], r["train_ms"]),
                        f"{r['train_ms']:.2f} ms a step",
                    ]
                )
    ew = reports.get("elementwise")
    if ew:
        envs.append(ew["environment"])
        n = max(r["n"] for r in ew["rows"])
        for kernel, layout, dtype in (("add_relu", "contiguous", "bfloat16"), ("add_relu", "transposed", "bfloat16")):
            r = _find(ew["rows"], kernel=kernel, layout=layout, dtype=dtype, n=n)
            if r:
                rows.append(
                    [
                        f"`add_relu`, {layout}, {SHORT[dtype]}, 2^{n.bit_length() - 1} elements",
                        "`torch.relu(x + y)`",
                        ratio(r["unfused_us"], r["fused_us"]),
                        f"{r['fused_gbps']:.0f} GB/s, {r['roof_share']:.0%} of the copy roof",
                    ]
                )
    mm = reports.get("matmul")
    if mm:
        envs.append(mm["environment"])
        for shape in ((4096, 4096, 4096),):
            r = _find(mm["matmul"], m=shape[0], n=shape[1], k=shape[2], dtype="bfloat16")
            if r:
                rows.append(
                    [
                        f"matmul + bias + ReLU, bf16, {' x '.join(map(str, shape))}",
                        "cuBLASLt's fused epilogue",
                        ratio(r["cublaslt_epilogue_us"], r["fusedkit_us"]),
                        f"{r['fusedkit_tflops']:.0f} TFLOP/s",
                    ]
                )
    lat = reports.get("latency")
    if lat:
        envs.append(lat["environment"])
        r = _find(lat["elementwise"], n=1024, dtype="float32")
        if r:
            rows.append(
                [
                    "`add_relu` per eager call, fp32, 1,024 elements",
                    "`torch.relu(x + y)` (two ops)",
                    ratio(r["relu(x + y)"], r["fusedkit.add_relu"]),
                    f"{r['fusedkit.add_relu']:.1f} us a call; `torch.add` {r['torch.add']:.1f} us",
                ]
            )
    bw = reports.get("backward")
    if bw and bw.get("linear_relu_training"):
        envs.append(bw["environment"])
        r = bw["linear_relu_training"][0]
        rows.append(
            [
                f"`LinearReLU` forward + backward, bf16, {r['m']} x {r['k']} x {r['n']}",
                "`nn.Linear` + `nn.ReLU`",
                ratio(r["torch_us"], r["fusedkit_us"]),
                f"{r['fusedkit_us']:.0f} us",
            ]
        )
    if not rows:
        return None
    env = envs[0]
    commits = sorted({(e.get("commit") or "?")[:12] for e in envs})
    dates = sorted({e.get("date", "")[:10] for e in envs})
    note = (
        f"<sub>Ratios: the peer's time over fusedkit's, above 1.00x fusedkit is faster; peers timed in the same "
        f"process (GPU times: `triton.testing.do_bench` medians; per-call times: back-to-back calls on the host). "
        f"{env.get('gpu')}, torch {env.get('torch')}, triton "
        f"{env.get('triton')}; fusedkit at {', '.join(commits)}; {', '.join(dates)}. Reproduce: "
        f"`bash scripts/results.sh`; every table: [docs/results.md](docs/results.md).</sub>"
    )
    return table(["case", "against", "speed-up", "fusedkit"], rows[:8], "llrl") + "\n\n" + note


RENDERERS = {
    "whole": whole,
    "models": models,
    "elementwise": elementwise,
    "ncu": ncu,
    "matmul": matmul,
    "latency": latency,
    "backward": backward,
    "norms": norms,
    "traffic": traffic,
    "advise": advise,
}


def replace_region(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- results:{name} -->).*?(<!-- /results:{name} -->)", re.DOTALL)
    return pattern.sub(lambda m: f"{m.group(1)}\n{body}\n{m.group(2)}", text)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    folder = Path(argv[0])
    reports = {name: load(folder, name) for name in RENDERERS}
    bodies, failed = {}, []
    for name, data in reports.items():
        if data is None:
            continue
        try:
            bodies[name] = RENDERERS[name](data)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # one bad file: the others still render
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
    head = headline(reports)
    if head:
        bodies["headline"] = head
    for target in TARGETS:
        text = target.read_text()
        for name, body in bodies.items():
            text = replace_region(text, name, body)
        target.write_text(text)
    print(f"rendered {', '.join(sorted(bodies)) or 'nothing'} from {folder}")
    if failed:
        print(f"could not render: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
