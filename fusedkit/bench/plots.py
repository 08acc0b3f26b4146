"""PNG figures of a report (``python -m fusedkit bench --plots DIR``); needs matplotlib."""

from __future__ import annotations

import os
from collections import defaultdict


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("--plots needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _stamp(env: dict) -> str:
    where = env.get("gpu") or f"{env.get('device')} ({env.get('backend')}: not GPU times)"
    return f"{where}, torch {env.get('torch')}, triton {env.get('triton')}, {env.get('date', '')}"


def _save(plt, fig, env: dict, path: str) -> str:
    fig.suptitle(_stamp(env), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_elementwise(rows: list[dict], env: dict, out_dir: str, traffic: list[dict] | None = None) -> list[str]:
    """GB/s against size with the copy roof, and bytes moved fused vs unfused."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    paths = []

    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        series = defaultdict(list)
        for r in rows:
            if r["dtype"] == dtype:
                series[(r["kernel"], r["layout"])].append(
                    (r["n"], r["fused_gbps"], r["bytes_fused"] / r["unfused_us"] / 1e3)
                )
        for (kernel, layout), pts in sorted(series.items()):
            pts.sort()
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{kernel} {layout}")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], ls=":", color=line.get_color())
        roof = next((r["roof_gbps"] for r in rows if r["dtype"] == dtype and r.get("roof_gbps")), None)
        if roof:
            ax.axhline(roof, color="k", ls="--", lw=1, label=f"copy roof {roof:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("elements")
        ax.set_ylabel("GB/s of the fused byte model")
        ax.set_title(f"{dtype}: fusedkit (solid) vs eager unfused (dotted)")
        ax.legend(fontsize=7)
    paths.append(_save(plt, fig, env, os.path.join(out_dir, "elementwise_gbps.png")))

    largest = max(r["n"] for r in rows)
    cases = [r for r in rows if r["n"] == largest]
    measured = {t["case"]: t for t in traffic or []}
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cases)), 4.5))
    labels = [f"{r['kernel']}\n{r['layout']}\n{r['dtype']}" for r in cases]
    xs = range(len(cases))
    width = 0.2 if measured else 0.35
    ax.bar([x - width for x in xs], [r["bytes_fused"] / 1e6 for r in cases], width, label="fused (model)")
    ax.bar(list(xs), [r["bytes_unfused"] / 1e6 for r in cases], width, label="unfused (model)")
    if measured:
        from .cases import case_name

        got = [measured.get(case_name(r["kernel"], r["layout"], r["dtype"], r["n"])) for r in cases]
        ax.bar(
            [x + width for x in xs],
            [(g["ncu_fused_read"] + g["ncu_fused_written"]) / 1e6 if g else 0 for g in got],
            width,
            label="fused (Nsight Compute)",
        )
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("MB moved per call")
    ax.set_title(f"DRAM bytes at n = {largest}", fontsize=9)
    ax.legend(fontsize=7)
    paths.append(_save(plt, fig, env, os.path.join(out_dir, "elementwise_bytes.png")))
    return paths


def plot_matmul(rows: list[dict], env: dict, out_dir: str) -> str:
    """TFLOP/s of relu(a @ b + bias): fusedkit against its peers, per shape and dtype."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    peers = [
        ("fusedkit", "fusedkit"),
        ("cublaslt_epilogue", "cuBLASLt epilogue"),
        ("addmm_relu", "addmm + relu"),
        ("matmul_bare", "bare matmul"),
    ]
    fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(rows)), 4.5))
    width = 0.2
    for i, (key, label) in enumerate(peers):
        ax.bar(
            [x + (i - 1.5) * width for x in range(len(rows))], [r[f"{key}_tflops"] for r in rows], width, label=label
        )
    ax.set_xticks(range(len(rows)), [f"{r['m']}x{r['n']}x{r['k']}\n{r['dtype']}" for r in rows], fontsize=6)
    ax.set_ylabel("TFLOP/s (2MNK / time)")
    ax.legend(fontsize=7)
    return _save(plt, fig, env, os.path.join(out_dir, "matmul_tflops.png"))
