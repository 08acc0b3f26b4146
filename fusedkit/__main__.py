"""``python -m fusedkit``: the command line (``bench`` is the fused-vs-unfused report).

The parser is built and run before anything heavy happens, so ``--help``, ``--version``
and a bad value (a choice, a size, a destination that cannot be written) answer at once,
as a usage error; the report then runs in :mod:`fusedkit.bench`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys

import torch

from . import __version__, registry
from .bench import BIAS_COLS, DTYPE_NAMES, LAYOUTS
from .bench.cases import make_operands
from .bench.models import MODELS
from .bench.report import CPU_SIZES, GPU_SIZES
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


#: The element counts a size may have: 1 to 2**40. A tensor of 2**40 fp16 elements is 2 TiB, beyond any
#: device's memory, and the count is far inside int64; more is a typo (2**70), not a report.
MAX_SIZE_LOG2 = 40
#: A number below this in --sizes is an exponent (20 = 2**20); from it up, an element count.
EXPONENT_BELOW = 64


def _sizes(text: str) -> list[int]:
    """``"20,2**24,4096"``: a number below 64, or ``2**N``, is a power of two (20 = 2**20); others are
    element counts. Every size is 1 to 2**40 elements; a size given twice runs once."""
    sizes = []
    for item in (s.strip() for s in text.split(",")):
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses
        match = re.fullmatch(r"(2\*\*)?([0-9]+)", item)
        if match is None:
            raise argparse.ArgumentTypeError(f"{item!r} is not a size (an element count, or 20 for 2**20)")
        value = int(match[2])
        if match[1] or value < EXPONENT_BELOW:
            if value > MAX_SIZE_LOG2:  # "63" would be 2**63 elements, "2**70" more than int64 counts
                why = "" if match[1] else f" (a number below {EXPONENT_BELOW} is a power of two)"
                raise argparse.ArgumentTypeError(
                    f"{item!r} is 2**{value} elements{why}; the exponent must be 0 to {MAX_SIZE_LOG2}"
                )
            value = 1 << value
        elif value > 1 << MAX_SIZE_LOG2:
            raise argparse.ArgumentTypeError(f"{item!r} is more than 2**{MAX_SIZE_LOG2} elements, the largest size")
        if value not in sizes:  # "20,2**20" runs 2**20 once
            sizes.append(value)
    return sizes


def _shapes(text: str) -> list[tuple[int, int, int]]:
    """``"4096x4096x4096,1x4096x4096"`` -> [(M, N, K), ...]: dims of at least 1, no operand
    (M x K, K x N, M x N) over 2**40 elements, the bound of --sizes."""
    shapes = []
    for item in text.split(","):
        match = re.fullmatch(r"([0-9]+)x([0-9]+)x([0-9]+)", item.strip().lower())
        if match is None:
            raise argparse.ArgumentTypeError(f"{item!r} is not MxNxK")
        m, n, k = (int(d) for d in match.groups())
        if min(m, n, k) < 1:
            raise argparse.ArgumentTypeError(f"{item!r} has a zero dimension; M, N and K are at least 1")
        if max(m * k, k * n, m * n) > 1 << MAX_SIZE_LOG2:
            raise argparse.ArgumentTypeError(f"{item!r} has an operand of more than 2**{MAX_SIZE_LOG2} elements")
        shapes.append((m, n, k))
    return shapes


def _positive_int(text: str) -> int:
    """An integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _output_file(text: str) -> str:
    """A file a report writes when it ends: its directory must exist and be writable now,
    not after the run it would hold the numbers of."""
    folder = os.path.dirname(os.path.abspath(text))
    if not text or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is {'a directory' if text else 'empty'}; name a file")
    if not os.path.isdir(folder):
        problem = "is not a directory" if os.path.exists(folder) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r}: its directory {folder} {problem}")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written (permission denied)")
    return text


def _output_dir(text: str) -> str:
    """``--plots DIR``: a writable directory, or a path the report can create (its nearest existing
    ancestor a writable directory: the plots call ``os.makedirs``)."""
    if not text:
        raise argparse.ArgumentTypeError("the directory is empty; name one")
    path = os.path.abspath(text)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = f"{text!r} is a file" if existing == path else f"{existing} is a file"
        raise argparse.ArgumentTypeError(f"{where}; name a directory that exists or can be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written (permission denied in {existing})")
    return text


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
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help=f"comma-separated; a number below {EXPONENT_BELOW} or 2**N is a power of two (20 = 2**20, exponents 0 to "
        f"{MAX_SIZE_LOG2}), a larger one an element count (at most 2**{MAX_SIZE_LOG2}); the bias and transposed "
        "layouts need sizes that fill their matrices (powers of two do, with the default --bias-cols) "
        "(default: the report's own)",
    )
    p.add_argument(
        "--layouts",
        type=_choices("layout", LAYOUTS),
        default=list(LAYOUTS),
        help=f"comma-separated, from {','.join(LAYOUTS)}",
    )
    p.add_argument(
        "--bias-cols",
        type=_positive_int,
        default=BIAS_COLS,
        help=f"columns of the bias layout, at least 1; it takes sizes up to this or multiples of it "
        f"(default: {BIAS_COLS})",
    )
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument(
        "--ncu",
        action="store_true",
        help="also read DRAM bytes with Nsight Compute (GPU with ncu on PATH) beside the model",
    )
    p.add_argument(
        "--plots",
        metavar="DIR",
        type=_output_dir,
        help="write PNG plots into DIR, created if missing (needs matplotlib)",
    )
    report = p.add_mutually_exclusive_group()
    report.add_argument("--matmul", action="store_true", help="the matmul-epilogue report instead")
    report.add_argument(
        "--backward",
        action="store_true",
        help="the backward and memory report instead (add_relu, the gates, bias + GELU; against eager and "
        "compiled torch)",
    )
    report.add_argument(
        "--norms",
        action="store_true",
        help="the norm family's report instead (rms_norm, layer_norm and their add + norm forms: forward "
        "against the copy roof, forward + backward against eager, compiled torch and Liger-Kernel)",
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
    model_groups = {
        "whole": [n for n, c in MODELS.items() if c.whole],
        "blocks": [n for n, c in MODELS.items() if not c.whole],
    }
    report.add_argument(
        "--models",
        type=_choices("model", models, groups=model_groups),
        nargs="?",
        const=list(models),
        default=None,
        metavar="NAMES",
        help="the real-model report instead (training step, inference, memory, "
        f"loss against stock eager and torch.compile); NAMES from "
        f"{','.join(models)}, or whole (the whole models) or blocks (default: all)",
    )
    p.add_argument(
        "--processes",
        type=_positive_int,
        default=1,
        metavar="N",
        help="--models and --latency only: run the report in N processes, one after another, and give "
        "each number's median and the range of the training step's (models) or the host time's ratio "
        "(latency) (default 1)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="hold this process, and those --processes starts, to one CPU core (the last it may use): the "
        "latency report's host times are measured so",
    )
    p.add_argument(
        "--add",
        action="store_true",
        help="--models with --json only: add this run's processes to those the --json file already holds "
        "(same GPU) and report the medians of each model's newest three; the record of six models in "
        "three processes, gathered over several short GPU leases",
    )
    p.add_argument(
        "--shapes",
        type=_shapes,
        default=None,
        help=f"matmul shapes MxNxK, comma-separated, dims at least 1, no operand over 2**{MAX_SIZE_LOG2} elements "
        "(default: the report's set)",
    )
    p.add_argument(
        "--tf32",
        action="store_true",
        help="allow TF32 in fp32 matmuls (torch.backends.cuda.matmul.allow_tf32), both sides",
    )
    p.add_argument(
        "--json", type=_output_file, help="write rows and environment to this JSON file (in a directory that exists)"
    )
    p.add_argument("--csv", type=_output_file, help="write rows to this CSV file (in a directory that exists)")
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
    a.add_argument(
        "--json",
        type=_output_file,
        help="write sites, timings and environment to this JSON file (in a directory that exists)",
    )
    a.add_argument("--no-progress", action="store_true", help="no progress bar")
    commands.add_parser(
        "build",
        help="build the C++ launch table ahead of the first call that would build it",
        description="Build (or find) the C++ extension that launches repeated eager calls and "
        "records their autograd nodes; needs a C++ compiler and ninja. Without it "
        "every call takes the Python path.",
    )
    return parser


#: What a size needs to fill a layout's matrix, for the message that refuses one.
_LAYOUT_NEEDS = {
    "bias": "a size at most --bias-cols ({bias_cols}) or a multiple of it",
    "transposed": "a power of two, or a multiple of its columns",
}


def check_bench(parser: argparse.ArgumentParser, args) -> None:
    """What no one option's type can see, refused with ``parser.error`` before any report starts:
    --json and --csv naming one file, and sizes the elementwise report's layouts cannot make."""
    if args.json and args.csv and os.path.realpath(args.json) == os.path.realpath(args.csv):
        parser.error(f"--json and --csv name the same file ({args.json}); name two")
    if args.add and not (args.models and args.json):
        parser.error("--add adds a models report's processes to a --json file: give --models and --json")
    if args.matmul or args.backward or args.norms or args.traffic or args.latency or args.models:
        return  # the other reports take contiguous sizes (any) or none
    given = args.sizes is not None
    sizes = args.sizes if given else (GPU_SIZES if torch.cuda.is_available() else CPU_SIZES)
    spec = registry.get(args.kernels[0])
    for n in sizes:
        for layout in args.layouts:
            # the report's own operands, on the meta device: a shape, no memory
            shape = make_operands(spec, layout, n, torch.float32, "meta", args.bias_cols)[0].shape
            if shape.numel() != n:
                what = f"--sizes {n}" if given else f"the default size {n}"
                need = _LAYOUT_NEEDS.get(layout, "another size").format(bias_cols=args.bias_cols)
                parser.error(
                    f"{what} does not fill the {layout} layout ({'x'.join(map(str, shape))} makes "
                    f"{shape.numel()} elements); it needs {need}, or leave {layout} out of --layouts"
                )


def build_native() -> int:
    """``python -m fusedkit build``: 0 when the extension is built (or was), 1 when it cannot be."""
    from .runtime import native

    path = native.library_path()
    print(f"fusedkit: repeated calls on this machine take {native.launch_path()}")
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
    if args.command == "bench":
        check_bench(parser, args)
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
