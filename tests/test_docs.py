"""The docs: every Python example runs, the site builds with --strict, and the
op table lists every registered kernel.

Examples: each fenced ``python`` block of ``docs/*.md`` is one test; a page's
blocks run in order in one namespace of their own (a block runs the blocks
before it first when they have not run yet, so ``-k`` picks any one). A block
whose first line is ``# gpu-only`` is skipped without CUDA and runs with it.
Without a GPU the kernels run in Triton's interpreter (conftest.py), so the
examples use small tensors.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import ON_GPU  # conftest sets TRITON_INTERPRET before fusedkit is imported

import fusedkit

pytestmark = pytest.mark.slow  # runs every docs example and builds the site

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GPU_ONLY = "# gpu-only"


# An opening fence of a Python block, at any indent, and the matching closing fence.
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^\n]*$", re.M)
_PYTHON = {"python", "py", "python3"}


@dataclass
class Block:
    page: str
    line: int
    source: str

    @property
    def gpu_only(self) -> bool:
        return self.source.lstrip().startswith(GPU_ONLY)


def extract_blocks(text: str, page: str) -> list[Block]:
    """Every fenced Python block of a markdown page, in order, with its first line number."""
    blocks, pos = [], 0
    while (m := _FENCE.search(text, pos)) is not None:
        indent, fence = m["indent"], m["fence"]
        close = re.compile(rf"^{re.escape(indent)}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", re.M)
        end = close.search(text, m.end())
        if end is None:
            raise AssertionError(f"{page}:{text.count(chr(10), 0, m.start()) + 1}: unclosed code fence")
        if m["lang"].lower() in _PYTHON:
            body = text[m.end() + 1 : end.start()]
            lines = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in body.splitlines()]
            blocks.append(Block(page, text.count("\n", 0, m.start()) + 2, "\n".join(lines) + "\n"))
        pos = end.end()
    return blocks


#: The docs pages and the README, by name ("README.md" lives at the root).
PAGE_PATHS = {p.name: p for p in sorted(DOCS.glob("*.md"))} | {"README.md": ROOT / "README.md"}
PAGES = list(PAGE_PATHS)
BLOCKS = [b for page in PAGES for b in extract_blocks(PAGE_PATHS[page].read_text(), page)]


@dataclass
class _PageRun:
    """One page's namespace and how far its blocks have run."""

    blocks: list[Block]
    namespace: dict = field(default_factory=dict)
    done: list = field(default_factory=list)  # per block: None (ran), "skipped" or the exception


_RUNS: dict[str, _PageRun] = {}


def _run_page_through(block: Block, tmp_dir: Path) -> object:
    """Run ``block``'s page up to and including ``block``; return its outcome."""
    run = _RUNS.setdefault(block.page, _PageRun([b for b in BLOCKS if b.page == block.page]))
    if not run.namespace:
        run.namespace.update(__name__=f"docs_{Path(block.page).stem.replace('-', '_')}")
    index = run.blocks.index(block)
    while len(run.done) <= index:
        current = run.blocks[len(run.done)]
        if current.gpu_only and not ON_GPU:
            run.done.append("skipped")
            continue
        earlier = [f"line {b.line}" for b, d in zip(run.blocks, run.done) if isinstance(d, Exception)]
        if earlier:
            run.done.append(AssertionError(f"an earlier block of {block.page} failed ({', '.join(earlier)})"))
            continue
        # A real file, so inspect.getsource works (@triton.jit reads the source of what it
        # decorates); blank lines first, so tracebacks give the line numbers of the page.
        path = tmp_dir / f"{Path(current.page).stem}_line{current.line}.py"
        path.write_text("\n" * (current.line - 1) + current.source)
        try:
            exec(compile(path.read_text(), str(path), "exec"), run.namespace)
            run.done.append(None)
        except Exception as e:
            run.done.append(e)
    return run.done[index]


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory):
    """Where the blocks run from; afterwards, the registry as it was before the examples."""
    before = set(fusedkit.registry.names())
    yield tmp_path_factory.mktemp("doc_examples")
    for name in set(fusedkit.registry.names()) - before:
        fusedkit.registry.unregister(name)


def test_there_are_examples():
    assert len(BLOCKS) >= 10, "the docs lost their examples"
    assert {"index.md", "elementwise.md", "custom-kernels.md", "models.md"} <= {b.page for b in BLOCKS}


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.page}:{b.line}" for b in BLOCKS])
def test_example(block: Block, example_dir: Path):
    if block.gpu_only and not ON_GPU:
        pytest.skip(f"{block.page}:{block.line} is marked {GPU_ONLY!r} and there is no CUDA GPU")
    outcome = _run_page_through(block, example_dir)
    if isinstance(outcome, Exception):
        raise outcome


def test_block_extraction():
    text = 'x\n```python\na = 1\n```\n\n```bash\nls\n```\n  ```py title="t"\n  # gpu-only\n  b = 2\n  ```\n'
    blocks = extract_blocks(text, "t.md")
    assert [b.source for b in blocks] == ["a = 1\n", "# gpu-only\nb = 2\n"]
    assert [b.line for b in blocks] == [3, 10] and blocks[1].gpu_only and not blocks[0].gpu_only
    with pytest.raises(AssertionError, match="unclosed"):
        extract_blocks("```python\na = 1\n", "t.md")


# --- the op table -------------------------------------------------------------------


def _gen_ops():
    spec = importlib.util.spec_from_file_location("docs_gen_ops", DOCS / "gen_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table_names(markdown: str) -> list[str]:
    return re.findall(r"^\| `(\w+)`", markdown, re.M)


def test_op_table_lists_every_registered_kernel():
    gen = _gen_ops()
    assert re.search(r"^hooks:\s*\n\s*-\s*docs/gen_ops\.py\s*$", (ROOT / "mkdocs.yml").read_text(), re.M), (
        "mkdocs.yml must run docs/gen_ops.py as a hook"
    )
    source = (DOCS / "elementwise.md").read_text()
    assert gen.MARKER in source, "docs/elementwise.md lost the op-table marker"
    rendered = gen.render(source)
    table = gen.ops_table()
    assert table in rendered and gen.MARKER not in rendered
    assert _table_names(table) == list(fusedkit.registry.names())
    for kernel in fusedkit.registry.kernels():
        assert f"`{kernel.formula}`" in table, kernel.name

    # The table follows the registry: a kernel registered now shows up.
    from fusedkit.kernels.activations import add_relu_math

    extra = fusedkit.registry.register(
        fusedkit.registry.ElementwiseKernel(
            name="docs_table_probe",
            math=add_relu_math,
            reference=lambda x, y, alpha=1: torch.relu(x + alpha * y),
            formula="probe(x, y)",
            unfused=("torch.add", "torch.relu"),
        )
    )
    try:
        assert _table_names(gen.ops_table())[-1] == extra.name
        assert "`probe(x, y)`" in gen.render(source)
    finally:
        fusedkit.registry.unregister(extra.name)


def test_norm_table_lists_every_row_kernel_with_its_byte_model():
    gen = _gen_ops()
    source = (DOCS / "models.md").read_text()
    assert gen.NORM_MARKER in source, "docs/models.md lost the norm-table marker"
    rendered, table = gen.render(source), gen.norm_table()
    assert table in rendered and gen.NORM_MARKER not in rendered
    names = re.findall(r"^\| `fusedkit\.(\w+)`", table, re.M)
    assert names == [k.name for k in fusedkit.registry.row_kernels()]
    add = fusedkit.registry.row_kernel("add_rms_norm")
    per_element = add.bytes_unfused(gen._NORM_ROWS, gen._NORM_WIDTH, torch.bfloat16).total / (
        gen._NORM_ROWS * gen._NORM_WIDTH
    )
    assert f"{per_element:.2f} (bf16)" in table.splitlines()[2 + names.index("add_rms_norm")]


def test_op_table_byte_columns_follow_the_model():
    row = _gen_ops().row(fusedkit.registry.get("add_relu"))
    assert "2 reads + 1 write = 12 B (fp32)" in row and "3 reads + 2 writes = 20 B (fp32)" in row


# --- the site -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    for plugin in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(plugin, reason="the docs build needs: pip install mkdocs-material 'mkdocstrings[python]'")
    out = tmp_path_factory.mktemp("site")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NO_MKDOCS_2_WARNING"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def test_site_builds_strict(site: Path):
    pages = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    for page in (p for p in PAGES if p != "README.md"):  # the README is the repository's, not the site's
        expected = "index.html" if page == "index.md" else f"{Path(page).stem}/index.html"
        assert expected in pages, f"{page} was not built"
    api = (site / "api/index.html").read_text()
    for name in (
        "fusedkit.add_relu",
        "fusedkit.matmul",
        "fusedkit.registry.ElementwiseKernel",
        "fusedkit.nn.LinearReLU",
        "fusedkit.testing.assert_matches_reference",
    ):
        assert f'id="{name}"' in api, f"the API reference lost {name}"


def test_built_op_table_lists_every_builtin_kernel(site: Path):
    html = (site / "elementwise/index.html").read_text()
    assert "fusedkit:op-table" not in html
    for name in sorted(fusedkit.registry.BUILTIN_NAMES):
        assert f"<td><code>{name}</code>" in html, f"{name} is missing from the built op table"
