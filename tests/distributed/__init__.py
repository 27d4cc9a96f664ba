"""Multi-process tests: real torchrun jobs on gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torchrun(worker: Path, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """``worker`` under torchrun on 2 ranks, autoweave's settings cleared; fails the test if it fails.

    A hang (ranks issuing different collectives) ends in the timeout, not in a stuck test run.
    """
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
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc
