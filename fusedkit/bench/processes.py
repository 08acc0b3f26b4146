"""A report in several processes, one after another (``--processes N``): one slow or drifting
host process cannot make or break a number. Each child is ``python -m fusedkit bench <argv>``
writing its JSON; its index is in :data:`PROCESS_ENV` (the latency report's host table starts
every other process with eager)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

__all__ = ["PROCESS_ENV", "run_children"]

PROCESS_ENV = "FUSEDKIT_BENCH_PROCESS"


def run_children(argv: list[str], processes: int, label: str, progress=True) -> tuple[list[dict], dict]:
    """(the JSON payloads of the processes that finished, {"process i": why} of those that did not)."""
    payloads, failed = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            path = os.path.join(tmp, f"{label}{i}.json")
            cmd = [sys.executable, "-m", "fusedkit", "bench", *argv, "--no-progress", "--json", path]
            if progress:
                print(f"[{label}] process {i + 1} of {processes}", file=sys.stderr, flush=True)
            env = dict(os.environ, **{PROCESS_ENV: str(i)})
            subprocess.run(cmd, check=False, env=env, stdout=sys.stderr if progress else subprocess.DEVNULL)
            try:
                with open(path) as f:
                    payloads.append(json.load(f))
            except (OSError, ValueError):  # (none written, or cut short)
                failed[f"process {i + 1}"] = "it wrote no results (it failed: see its output)"
    return payloads, failed
