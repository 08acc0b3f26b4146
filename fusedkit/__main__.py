"""``python -m fusedkit``: the command line (``bench`` is the fused-vs-unfused report).

The parser is built and run before anything heavy happens, so ``--help``, ``--version``
and a bad choice answer at once; the report then runs in :mod:`fusedkit.bench`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

from . import __version__, registry
from .bench import BIAS_COLS, DTYPE_NAMES, LAYOUTS
from .bench.models import MODELS
from .runtime.elementwise import INTERPRETED


def _choices(kind: str, allowed, aliases=None, groups=None):
    """An argparse type for a comma-separated list drawn from ``allowed`` (``aliases`` maps
    other spellings onto them, ``groups`` a name onto several); a bad item is a usage error
    naming the choices."""
    aliases, groups = aliases or {}, groups or {}

    def parse(text: str) -> list[str]:
        items = []
        for item in (s.strip() for s in text.split(",")):
            for name in groups.get(item, (aliases.get(item, item),)):
                if name not in allowed:
                    raise argparse.ArgumentTypeError(
                        f"unknown {kind} {item!r}; choose from {', '.join((*groups, *allowed))}"
                    )
                if name not in items:  # "a,a" runs a once
                    items.append(name)
        return items

    return parse


def _sizes(text: str) -> list[int]:
    """``"20,24,4096"``: numbers below 64 are powers of two (20 = 2**20), others element counts."""
    sizes = []
    for item in (s.strip() for s in text.split(",")):
        value = int(item[3:]) if item.startswith("2**") and item[3:].isdigit() else int(item) if item.isdigit() else -1
        if value < 0:
            raise argparse.ArgumentTypeError(f"{item!r} is not a size (an element count, or 20 for 2**20)")
        sizes.append(1 << value if value < 64 else value)
    return sizes


def _shapes(text: str) -> list[tuple[int, int, int]]:
    """``"4096x4096x4096,1x4096x4096"`` -> [(M, N, K), ...]."""
    shapes = []
    for item in text.split(","):
        dims = item.strip().lower().split("x")
        if len(dims) != 3 or not all(d.isdigit() for d in dims):
            raise argparse.ArgumentTypeError(f"{item!r} is not MxNxK")
        shapes.append(tuple(int(d) for d in dims))
    return shapes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fusedkit", description="fusedkit: fused GPU kernels in Triton for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"fusedkit {__version__} (torch {torch.__version__})")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    p = commands.add_parser(
        "bench",
        help="the fused-vs-unfused report (also --matmul, --latency, --backward)",
        description="Time fusedkit's kernels beside the unfused PyTorch ops they replace, "
        "peers in the same process; on a CPU, in Triton's interpreter.",
    )
    kernels = registry.names()
    dtypes = tuple(DTYPE_NAMES)
    # "ops": the entries model code calls (each has a backward), not the gradient kernels
    ops = tuple(k.name for k in registry.kernels() if k.backward is not None)
    p.add_argument(
        "--kernels",
        type=_choices("kernel", kernels, groups={"ops": ops}),
        default=list(kernels),
        help=f"comma-separated registry names, or ops: those with a backward ({','.join(ops)}) "
        f"(default: all: {','.join(kernels)})",
    )
    p.add_argument(
        "--dtypes",
        type=_choices("dtype", dtypes, {str(v)[6:]: k for k, v in DTYPE_NAMES.items()}),
        default=["fp32", "bf16"],
        help=f"comma-separated, from {','.join(dtypes)} (default: fp32,bf16)",
    )
    p.add_argument("--sizes", type=_sizes, default=None, help="element counts or powers of two (20 = 2**20)")
    p.add_argument(
        "--layouts",
        type=_choices("layout", LAYOUTS),
        default=list(LAYOUTS),
        help=f"comma-separated, from {','.join(LAYOUTS)}",
    )
    p.add_argument("--bias-cols", type=int, default=BIAS_COLS, help="columns of the bias layout")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument(
        "--ncu",
        action="store_true",
        help="also read DRAM bytes with Nsight Compute (GPU with ncu on PATH) beside the model",
    )
    p.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR (needs matplotlib)")
    report = p.add_mutually_exclusive_group()
    report.add_argument("--matmul", action="store_true", help="the matmul-epilogue report instead")
    report.add_argument(
        "--backward",
        action="store_true",
        help="the backward and memory report instead (add_relu, the gates, bias + GELU; against eager and "
        "compiled torch)",
    )
    report.add_argument(
        "--traffic",
        action="store_true",
        help="the byte counter against Nsight Compute's DRAM bytes, op by op, in a ResNet-50 "
        "Bottleneck's and a SwiGLU MLP's training step instead (GPU with ncu on PATH)",
    )
    report.add_argument(
        "--latency", action="store_true", help="the small-tensor report instead: host time per call against torch"
    )
    models = tuple(MODELS)
    report.add_argument(
        "--models",
        type=_choices("model", models),
        nargs="?",
        const=list(models),
        default=None,
        metavar="NAMES",
        help="the real-model report instead (training step, inference, memory, "
        f"loss against stock eager and torch.compile); NAMES from "
        f"{','.join(models)} (default: all)",
    )
    p.add_argument(
        "--shapes", type=_shapes, default=None, help="matmul shapes MxNxK, comma-separated (default: the report's set)"
    )
    p.add_argument(
        "--tf32",
        action="store_true",
        help="allow TF32 in fp32 matmuls (torch.backends.cuda.matmul.allow_tf32), both sides",
    )
    p.add_argument("--json", help="write rows and environment to this JSON file")
    p.add_argument("--csv", help="write rows to this CSV file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = commands.add_parser(
        "advise",
        help="fusedkit.advise and fuse on the real models: sites, bytes, time",
        description="Find where fusedkit fuses the model report's stock models (fusedkit.advise), "
        "and time the model fusedkit.fuse returns against the original.",
    )
    a.add_argument(
        "--models",
        type=_choices("model", models),
        default=list(models),
        help=f"comma-separated, from {','.join(models)} (default: all)",
    )
    a.add_argument("--json", help="write sites, timings and environment to this JSON file")
    a.add_argument("--no-progress", action="store_true", help="no progress bar")
    commands.add_parser(
        "build",
        help="build the C++ launch table ahead of the first call that would build it",
        description="Build (or find) the C++ extension that launches repeated eager calls and "
        "records their autograd nodes; needs a C++ compiler and ninja. Without it "
        "every call takes the Python path.",
    )
    return parser


def build_native() -> int:
    """``python -m fusedkit build``: 0 when the extension is built (or was), 1 when it cannot be."""
    from .runtime import native

    path = native.library_path()
    try:
        native.build()
    except Exception as exc:  # no compiler, no ninja: the Python path runs every call
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"fusedkit: the C++ launch table did not build ({first}); calls take the Python path", file=sys.stderr)
        return 1
    print(f"fusedkit: C++ launch table at {path}")
    return 0


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "build":
        return build_native()
    if args.command == "bench" and args.plots and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plots needs matplotlib: pip install matplotlib (or fusedkit[bench])")
    if not torch.cuda.is_available() and not INTERPRETED:
        # Triton chooses the interpreter when it decorates the kernels, which has
        # happened already: start again with it on, so the report runs the real kernels.
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "fusedkit", *argv], env)
    if args.command == "advise":
        from .bench.advice import run_advise_command

        return run_advise_command(args)
    from .bench import run_command

    return run_command(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
