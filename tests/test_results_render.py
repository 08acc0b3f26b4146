"""The committed results of record render, and the docs hold what they render to."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks" / "results" / "h200"


@pytest.fixture(scope="module")
def render():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "benchmarks" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _region(text: str, name: str) -> str:
    start, end = f"<!-- results:{name} -->\n", f"\n<!-- /results:{name} -->"
    return text[text.index(start) + len(start) : text.index(end)]


def test_every_record_renders_into_the_docs_as_committed(render):
    # (a record changed without running the renderer, or a renderer changed without
    # re-rendering, leaves the docs saying something the records do not)
    reports = {name: render.load(RECORDS, name) for name in render.RENDERERS}
    assert reports["models"] is not None and reports["elementwise"] is not None
    bodies = {name: render.RENDERERS[name](data) for name, data in reports.items() if data is not None}
    bodies["headline"] = render.headline(reports)
    for target in render.TARGETS:
        text = target.read_text()
        for name, body in bodies.items():
            if f"<!-- results:{name} -->" in text:
                assert _region(text, name) == body, f"{target.name}: the {name} table is not the record's"


def test_columns_newer_than_a_record_render_as_dashes(render):
    models = render.load(RECORDS, "models")
    row = next(r for r in models["models"] if r["variant"] == "eager")
    row.pop("host_ms", None)  # (a record written before the host column)
    table = render.models(models)
    assert "| host ms |" in table and table.splitlines()[2].split("|")[6].strip() == "-"
    advise = render.load(RECORDS, "advise")
    for t in advise["timings"]:
        t.pop("original_forward_gpu_ms", None)
    assert "| - |" in render.advise(advise)


def test_a_latency_record_with_norm_rows_renders_them(render):
    # (the record of record predates the norm rows: it renders without them, as committed above)
    latency = render.load(RECORDS, "latency")
    row = {"dtype": "bfloat16", "rows": 16, "n": 2048, "op": "add_rms_norm", "fusedkit": 30.0, "eager": 20.0}
    row.update({"fusedkit fwd+bwd": 60.0, "eager fwd+bwd": 80.0})
    text = render.latency({**latency, "norms": [row]})
    assert "| bf16 | 16 | 2048 | `add_rms_norm` | 30.0 | 20.0 | 1.50 | 60.0 | 80.0 | 0.75 |" in text


def test_a_latency_record_with_host_rows_renders_one_row_per_op_and_mode(render):
    latency = render.load(RECORDS, "latency")
    host = [
        {"op": "add", "shape": "1024", "mode": "forward", "fusedkit host": 6.0, "eager host": 8.0},
        {"op": "add", "shape": "65536", "mode": "forward", "fusedkit host": 9.0, "eager host": 6.0},
        {"op": "matmul", "shape": "1x1024x1024", "mode": "fwd+bwd", "fusedkit host": 30.0, "eager host": 40.0},
    ]
    text = render.latency({**latency, "host": host, "host dtype": "bfloat16", "processes": 3})
    assert "Host time a call (bf16), the GPU idle before each call, median of 3 processes" in text
    assert "2 of 3 at or below 1.00" in text
    assert "| `add` | forward | 0.75 (6.0) | 1.50 (9.0) |  |" in text
    assert "| `matmul` | fwd+bwd |  |  | 0.75 (30.0) |" in text
