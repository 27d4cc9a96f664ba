"""The torchrun launcher runs a job again only after gloo's teardown abort, and only once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.distributed import TEARDOWN_ABORT, run_ranks

# Fails with ``message`` on its first ``fails`` runs (counted in a file), then succeeds.
_JOB = """
import pathlib, sys
count = pathlib.Path(sys.argv[1]); n = int(count.read_text() or 0) if count.exists() else 0
count.write_text(str(n + 1))
if n < int(sys.argv[2]):
    sys.stderr.write(sys.argv[3] + "\\n"); sys.exit(134)
"""


def _run(tmp_path: Path, fails: int, message: str) -> int:
    count = tmp_path / "count"
    cmd = [sys.executable, "-c", _JOB, str(count), str(fails), message]
    try:
        run_ranks(cmd, dict(os.environ), timeout=60)
    finally:
        runs = int(count.read_text())
    return runs


def test_a_teardown_abort_runs_the_job_once_more(tmp_path: Path) -> None:
    assert _run(tmp_path, 1, TEARDOWN_ABORT) == 2


def test_the_same_abort_twice_fails(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=TEARDOWN_ABORT):
        _run(tmp_path, 2, TEARDOWN_ABORT)
    assert int((tmp_path / "count").read_text()) == 2


def test_any_other_failure_fails_at_once(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="RuntimeError"):
        _run(tmp_path, 1, "RuntimeError: a rank failed")
    assert int((tmp_path / "count").read_text()) == 1
