"""The real-clients lane (``.ci/clients``): real client packages at pinned versions, their own code paths.

Every test here is marked ``clients`` and runs only when selected with ``-m clients``: the
main lane collects ``tests/`` and would otherwise spend minutes on client runs (and the
clients' packages are pinned in ``.ci/clients``' venv, not in ``.[test]``). A test whose
client package is not importable is skipped.

Each worker run (a subprocess, 2 gloo ranks under torchrun where the client supports it) is
made once per session and shared by the tests that read it: ``client_run(worker, setting,
*args)``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runner  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "clients: real client stacks (accelerate, Trainer, torchtitan, NeMo, Lightning) in subprocesses; .ci/clients",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr = config.getoption("markexpr", "") or ""
    if "clients" in markexpr and "not clients" not in markexpr:
        return
    skip = pytest.mark.skip(reason="real-client lane: run with `-m clients` (.ci/clients)")
    for item in items:
        if "clients" in item.keywords:
            item.add_marker(skip)


_RUNS: dict[tuple[Any, ...], _runner.Run] = {}


@pytest.fixture(scope="session")
def client_run():
    """``client_run(worker, setting, *worker_args, nproc=2, env=None)``: a worker run, made once per session."""

    def run(
        worker: str, setting: str, *worker_args: str, nproc: int = 2, env: dict | None = None, timeout=600
    ):
        key = (worker, setting, worker_args, nproc, tuple(sorted((env or {}).items())))
        if key not in _RUNS:
            _RUNS[key] = _runner.run_worker(
                worker, setting, list(worker_args), nproc=nproc, env=env, timeout=timeout
            )
        return _RUNS[key]

    return run
