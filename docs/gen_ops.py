"""The op table of ``docs/elementwise.md``, generated from ``fusedkit.registry``.

MkDocs runs this file as a hook (``hooks:`` in ``mkdocs.yml``): every page that
holds the marker line ``<!-- fusedkit:op-table -->`` gets the table in its
place, built from the registry at build time, so a registered kernel cannot be
missing from the docs. ``python docs/gen_ops.py`` prints the table. The hook
also strips the reST role prefixes (``:func:``) that docstrings bring into the
API reference, and adds the plots of the committed GPU runs (``PLOTS``)
to the site as ``img/*.png``, so the figures are not copied into ``docs/``.

Importing fusedkit launches nothing, so this runs on a machine without a GPU.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the mkdocs script does not put the repository root on sys.path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import fusedkit  # noqa: E402
from fusedkit.registry import ElementwiseKernel  # noqa: E402

MARKER = "<!-- fusedkit:op-table -->"
#: The norm family's table (``fusedkit.registry.row_kernels``), on the page that documents it.
NORM_MARKER = "<!-- fusedkit:norm-table -->"
#: Pages that must hold a marker: the build fails when it is gone.
TABLE_PAGES = {"elementwise.md": MARKER, "models.md": NORM_MARKER}
#: The committed GPU runs whose plots the docs show: ``benchmarks/results/<run>/<name>``.
PLOTS = {"elementwise_gbps.png": "h200", "elementwise_bytes.png": "h200", "matmul_tflops.png": "h200"}

_SHORT = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "int32",
    torch.int64: "int64",
}
#: Elements in the operands the byte model is evaluated on (meta tensors: no memory).
_N = 4096

HEADER = (
    "| op | formula | operands | scalar | dtypes | replaces (eager) | fused, per element | "
    "unfused, per element | backward |"
)
RULE = "|---|---|---|---|---|---|---|---|---|"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _moves(kernel: ElementwiseKernel) -> tuple[str, str]:
    """Bytes per output element, fused and unfused, from the kernel's own byte model.

    Evaluated on same-shape contiguous operands of one dtype (fp32 when the kernel
    takes it), so the count of element-sized moves holds for every dtype.
    """
    dtype = torch.float32 if torch.float32 in kernel.dtypes else kernel.dtypes[0]
    size = torch.empty((), dtype=dtype).element_size()
    ops = tuple(torch.empty(_N, dtype=dtype, device="meta") for _ in kernel.arg_names)
    cells = []
    for traffic in (kernel.bytes_fused(*ops), kernel.bytes_unfused(*ops)):
        reads, writes = traffic.read // (_N * size), traffic.written // (_N * size)
        cells.append(
            f"{reads} reads + {writes} write{'s' if writes != 1 else ''} = {traffic.total // _N} B ({_SHORT[dtype]})"
        )
    return cells[0], cells[1]


def _backward(kernel: ElementwiseKernel) -> str:
    if kernel.backward is None:
        return "not differentiable"
    if kernel.saves == "pre":
        return f"saves {kernel.pre.name}'s result"
    return {"none": "saves nothing", "output": "saves the output", "inputs": "saves the inputs"}[kernel.saves]


def _call(kernel: ElementwiseKernel) -> str:
    public = getattr(fusedkit, kernel.name, None)
    if callable(public) and getattr(public, "__module__", "").startswith("fusedkit"):
        return f"`fusedkit.{kernel.name}`"
    return f'`elementwise("{kernel.name}", ...)`'


def row(kernel: ElementwiseKernel) -> str:
    fused, unfused = _moves(kernel)
    scalar = f"`{kernel.param}={kernel.param_default}`" if kernel.param else "-"
    cells = [
        f"`{kernel.name}`<br>{_call(kernel)}",
        f"`{_cell(kernel.formula or kernel.name)}`",
        ", ".join(f"`{a}`" for a in kernel.arg_names),
        scalar,
        ", ".join(_SHORT[d] for d in kernel.dtypes),
        " then ".join(f"`{op}`" for op in kernel.unfused),
        fused,
        unfused,
        _backward(kernel),
    ]
    return "| " + " | ".join(cells) + " |"


def ops_table(kernels=None) -> str:
    """The markdown table: one row per registered kernel, in registration order."""
    kernels = list(fusedkit.registry.kernels() if kernels is None else kernels)
    return "\n".join([HEADER, RULE, *(row(k) for k in kernels)])


#: The norm table's shape: rows of this width, bf16 inputs and a float32 weight (a
#: mixed-precision model's), bytes per row element.
_NORM_WIDTH, _NORM_ROWS = 4096, 1024


def norm_table(kernels=None) -> str:
    """The norm family's table: one row per :class:`fusedkit.registry.RowKernel`."""
    kernels = list(fusedkit.registry.row_kernels() if kernels is None else kernels)
    lines = [
        "| op | formula | dtypes | replaces (eager) | fused, bytes per element | unfused, bytes per element |",
        "|---|---|---|---|---|---|",
    ]
    elements = _NORM_WIDTH * _NORM_ROWS
    for k in kernels:
        fused, unfused = (
            f(_NORM_ROWS, _NORM_WIDTH, torch.bfloat16).total / elements for f in (k.bytes_fused, k.bytes_unfused)
        )
        cells = [
            f"`fusedkit.{k.name}`",
            f"`{_cell(k.formula)}`",
            ", ".join(_SHORT[d] for d in k.dtypes) + " (fp64: PyTorch's)",
            " then ".join(f"`{op}`" for op in k.unfused),
            f"{fused:.2f} (bf16)",
            f"{unfused:.2f} (bf16)",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(markdown: str) -> str:
    """``markdown`` with the marker lines replaced by the tables."""
    return markdown.replace(MARKER, ops_table()).replace(NORM_MARKER, norm_table())


def on_page_markdown(markdown, page, config, files):
    """MkDocs hook: put the tables where the markers are."""
    marker = TABLE_PAGES.get(page.file.src_uri)
    if marker is not None and marker not in markdown:
        raise RuntimeError(f"docs/{page.file.src_uri} lost its table marker {marker!r}")
    return render(markdown) if MARKER in markdown or NORM_MARKER in markdown else markdown


def on_files(files, config):
    """MkDocs hook: serve the committed run's plots as ``img/<name>.png``."""
    from mkdocs.structure.files import File

    for name, run in PLOTS.items():
        path = ROOT / "benchmarks" / "results" / run / name
        if not path.is_file():
            raise RuntimeError(f"{path} is missing: the docs show it")
        files.append(File.generated(config, f"img/{name}", abs_src_path=str(path)))
    return files


_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc):(?=<code>)")


def on_page_content(html, page, config, files):
    """MkDocs hook: drop the reST role prefixes (``:func:``) that docstrings carry into the API page."""
    return _ROLE.sub("", html)


if __name__ == "__main__":
    print(ops_table())
    print()
    print(norm_table())
