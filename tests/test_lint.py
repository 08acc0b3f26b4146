"""The code's form is ruff's (configured in pyproject.toml), and CI checks it before the tests."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _ruff() -> list[str] | None:
    try:
        import ruff  # noqa: F401
    except ImportError:
        return ["ruff"] if shutil.which("ruff") else None
    return [sys.executable, "-m", "ruff"]


def test_ci_lints_before_it_tests():
    steps = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("bash ")]
    assert steps == ["bash scripts/run.sh lint", "bash scripts/run.sh test"]
    assert "[tool.ruff]" in (ROOT / "pyproject.toml").read_text()


@pytest.mark.parametrize("command", [("check",), ("format", "--check")], ids=["check", "format"])
def test_the_tree_passes_ruff(command):
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (bash scripts/run.sh lint installs it)")
    done = subprocess.run([*ruff, *command, "."], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
