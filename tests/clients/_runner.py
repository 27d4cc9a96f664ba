"""Launch a client worker in a subprocess (torchrun for 2 ranks) and read its result line.

Shared by ``tests/clients/test_*.py`` and ``benchmarks/clients.py``. Each run gets a clean
environment as far as autoweave goes: every ``AUTOWEAVE*`` variable is dropped and only
the ones the caller names are set, so ``plain`` really is ``AUTOWEAVE`` unset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULT_TAG = "CLIENT_RESULT "

# How each compared setting is spelled in the environment.
SETTINGS: dict[str, dict[str, str]] = {
    "plain": {},
    "autoweave": {"AUTOWEAVE": "1"},
    "hoist": {"AUTOWEAVE": "1", "AUTOWEAVE_STRATEGY": "hoist"},
    "pieces": {"AUTOWEAVE": "1", "AUTOWEAVE_STRATEGY": "pieces"},
}

# Lines every torchrun/gloo/CPU run prints whatever autoweave does: not "extra output".
_NOISE = (
    "torch/distributed/run.py",
    "*****",
    "Setting OMP_NUM_THREADS",
    "USDT:",
    "SyncActivityProfilerHandler",
    "profiler_start",
    "profiler_stop",
)


@dataclass
class Run:
    worker: str
    setting: str
    args: list[str]
    rc: int
    wall_s: float
    result: dict[str, Any] | None
    stdout: str
    stderr: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.rc == 0 and bool(self.result) and bool(self.result.get("ok"))

    def get(self, key: str, default: Any = None) -> Any:
        return (self.result or {}).get(key, default)

    def stderr_lines(self) -> list[str]:
        """stderr without torchrun's and the profiler's own banner lines."""
        return [
            line for line in self.stderr.splitlines() if line.strip() and not any(n in line for n in _NOISE)
        ]

    def command(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{env} {sys.executable} {' '.join(self.args)}".strip()

    def describe(self) -> str:
        tail = "\n".join(self.stderr.splitlines()[-40:])
        return f"{self.command()}\nrc={self.rc} result={json.dumps(self.result)}\n--- stderr tail ---\n{tail}"


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE") and k != "TORCH_LOGS"}
    env.update(extra)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_worker(
    worker: str,
    setting: str = "plain",
    worker_args: list[str] | None = None,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> Run:
    """Run ``tests/clients/<worker>.py`` under ``setting`` (a key of ``SETTINGS``) with ``nproc`` ranks."""
    script = str(HERE / f"{worker}.py")
    extra = dict(SETTINGS[setting])
    extra.update(env or {})
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script]
    else:
        args = [script]
    args += list(worker_args or [])
    full_env = _clean_env(extra)
    start = time.perf_counter()
    for attempt in (1, 2):
        rc, out, err = _run_once(args, full_env, timeout)
        # gloo's teardown abort after the job's work (see tests/distributed/__init__.py): once more.
        if rc == 0 or attempt == 2 or _TEARDOWN_ABORT not in err:
            break
    wall = time.perf_counter() - start
    result = None
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG) :])
    return Run(worker, setting, args, rc, round(wall, 1), result, out, err, env=extra)


_TEARDOWN_ABORT = "terminate called without an active exception"


def _run_once(args: list[str], full_env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    with tempfile.TemporaryDirectory(prefix="aw-clients-") as tmp:
        full_env = {**full_env, "TMPDIR": full_env.get("TMPDIR", tmp)}
        try:
            proc = subprocess.run(
                [sys.executable, *args],
                cwd=str(ROOT),
                env=full_env,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc = 124
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = (
                exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            ) + "\n[timed out]"
    return rc, out, err


def importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require(module: str) -> None:
    """Skip the calling test when ``module`` (a client package) is not importable."""
    import pytest

    if not importable(module):
        pytest.skip(f"{module} is not installed (the real-client lane installs it: .ci/clients)")


def max_rel_diff(a: list[float] | None, b: list[float] | None) -> float | None:
    """The largest relative difference between two loss curves (None when either is missing)."""
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


_TIMESTAMP = __import__("re").compile(r"^(\[rank\d+\]:)?[IWEDC]\d{4} [\d:.]+ \d+ ")


def normalised_stderr(run: Run) -> list[str]:
    """stderr lines with torchrun/profiler banners, rank prefixes, timestamps and pids removed, sorted."""
    lines = []
    for line in run.stderr_lines():
        lines.append(_TIMESTAMP.sub("", line).strip())
    return sorted(lines)
