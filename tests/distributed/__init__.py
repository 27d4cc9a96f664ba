"""Multi-process tests: real torchrun jobs on gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# gloo's teardown race: a C++ worker thread that still holds a finished collective's tensors
# takes the GIL while the interpreter finalizes; Python 3.11 ends that thread with
# pthread_exit, which unwinds through a noexcept frame and aborts the rank after its work
# (pytorch#190489; pytorch#179291, an atexit destroy, was abandoned). Seen once in CI (torch
# 2.14.1, the example with autoweave on, after the exit report) and in 0 of 52 runs here.
TEARDOWN_ABORT = "terminate called without an active exception"


def run_ranks(
    cmd: Sequence[str], env: dict[str, str], *, timeout: int, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """``cmd`` (a torchrun command) run to the end; fails the test if it fails.

    Run once more, and only once, when a rank aborted with ``TEARDOWN_ABORT``
    (the interpreter's teardown, not the job's work); any other failure, or that
    abort twice, fails. A hang ends in the timeout.
    """
    for attempt in (1, 2):
        proc = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if proc.returncode == 0 or attempt == 2 or TEARDOWN_ABORT not in proc.stderr:
            break
        print(f"run_ranks: a rank aborted in gloo's teardown; running again: {' '.join(cmd)}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def torchrun(worker: Path, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """``worker`` under torchrun on 2 ranks, autoweave's settings cleared; fails the test if it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(worker),
        *args,
    ]
    return run_ranks(cmd, env, timeout=timeout)
