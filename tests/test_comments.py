"""Comments and docstrings quote no timings that age (issue 45 item 17).

A measured time or throughput written beside the code goes stale with the next Triton,
driver or GPU, and nobody re-measures a comment. A comment that gives a measurement as the
reason for a design choice keeps at most one number, preferably a ratio, and says where
current figures live (docs/results.md, docs/design.md, ``python -m fusedkit bench ...``).
This test scans the package's comments and docstrings for figures in microseconds,
milliseconds, nanoseconds, TFLOP/s, GB/s or TB/s; the few that remain are listed below,
each with its reason.
"""

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fusedkit"

#: A number and a unit of time or throughput ("12.5 us", "300us", "81.6 TFLOP/s").
TIMING = re.compile(r"(?<![\w.])\d[\d.,]*\s?(?:us|µs|μs|ms|ns|TFLOP/s|GB/s|TB/s)(?![\w/])")

#: (file, figure) -> why it stays: the one number that makes a comment's reason, where no
#: results page times it.
ALLOWED = {
    ("fusedkit/sharding.py", "2.4 ms"): "why every argument keys DTensor's propagation cache: the cost of "
    "propagating again for a new scalar value, on a CPU host; no report times it",
}


def _doc_texts(source: str):
    """(line, text) of every comment and every string statement (docstrings, ``#:``-style
    attribute docs written as strings) in ``source``."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def timings_in(source: str) -> list[tuple[int, str]]:
    """(line, figure) of each timing figure in ``source``'s comments and docstrings."""
    return [(line, m.group()) for line, text in _doc_texts(source) for m in TIMING.finditer(text)]


def _found() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for line, figure in timings_in(path.read_text(encoding="utf-8")):
            found.setdefault((name, re.sub(r"\s+", " ", figure)), []).append(line)
    return found


def test_the_scanner_finds_timings_in_comments_and_docstrings_only():
    source = '''"""Module doc: 38.6 us."""
X = 1  # a comment: 1013 us masked
#: an attribute doc: 81.6 TFLOP/s
REP_MS = 100  # a budget in ms, not a figure
HEADER = f"{'fused us':>9}"  # a column name, in code


def f():
    """Takes 2.4 ms, at 3.5 TB/s."""
    return "a string in code: 14 us"
'''
    assert timings_in(source) == [(2, "1013 us"), (3, "81.6 TFLOP/s"), (1, "38.6 us"), (9, "2.4 ms"), (9, "3.5 TB/s")]
    assert timings_in("# instruction counts (149 instructions), sizes (64 MiB), errors (1.9e-6), 30 s\n") == []


def test_comments_quote_no_ageing_timings():
    new = [
        f"{name}:{line}: {figure}"
        for (name, figure), lines in _found().items()
        if (name, figure) not in ALLOWED
        for line in lines
    ]
    assert not new, (
        "comments or docstrings quote measured times or throughputs, which age: keep at most one "
        "number (a ratio) and say where current figures live (docs/results.md, docs/design.md, "
        "python -m fusedkit bench ...), or allow-list it in tests/test_comments.py with its reason:\n" + "\n".join(new)
    )


def test_the_allow_list_is_current():
    found = _found()
    stale = [key for key in ALLOWED if key not in found]
    assert not stale, f"allow-listed figures no longer in the code (remove their entries): {stale}"
