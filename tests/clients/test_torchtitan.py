"""torchtitan 0.3: its own ``parallelize_qwen3`` (selective AC, per-block ``fullgraph=True`` compile,
FSDP2) on a CPU mesh, 2 gloo ranks. autoweave must be a true no-op here.

Worker: ``tests/clients/torchtitan_worker.py``. torchtitan 0.3 shards routed experts with their
block (no nested FSDP unit), so nothing breaks the graph under a checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runner  # noqa: E402

pytestmark = pytest.mark.clients
WORKER = "torchtitan_worker"
LAYERS = ("--layers", "10")
SAME = (
    "graphs",
    "ops",
    "compiles",
    "recompiles",
    "unique_graphs",
    "calls_captured",
    "fallbacks",
    "graph_breaks",
)


@pytest.fixture(scope="module", autouse=True)
def _needs_torchtitan():
    _runner.require("torchtitan")


def test_autoweave_is_a_true_no_op(client_run):
    plain = client_run(WORKER, "plain", *LAYERS, "--measure")
    woven = client_run(WORKER, "autoweave", *LAYERS, "--measure")
    eager = client_run(WORKER, "plain", *LAYERS, "--no-compile")
    for run in (plain, woven, eager):
        assert run.ok, run.describe()
    assert woven.get("autoweave_active")
    for key in SAME + ("fwd_gemms_eager", "fwd_gemms_compiled", "bwd_gemms", "recompile_limit_hits"):
        assert woven.get(key) == plain.get(key), (key, woven.result, plain.result)
    assert plain.get("fallbacks") == 0 and plain.get("recompiles") == 0
    assert woven.get("losses") == plain.get("losses")  # bit for bit
    assert _runner.max_rel_diff(woven.get("losses"), eager.get("losses")) < 1e-4
    # Nothing extra on stderr: the same lines (timestamps, pids and rank order aside).
    assert _runner.normalised_stderr(woven) == _runner.normalised_stderr(plain)


def test_with_the_report_no_recompile_limit_and_only_the_summary_on_stderr(client_run, tmp_path_factory):
    report = tmp_path_factory.mktemp("titan-report") / "r{rank}.json"
    plain = client_run(WORKER, "plain", *LAYERS, "--measure")
    woven = client_run(WORKER, "autoweave", *LAYERS, env={"AUTOWEAVE_REPORT": str(report)})
    assert plain.ok, plain.describe()
    assert woven.ok, woven.describe()
    assert "FailOnRecompileLimitHit" not in woven.stderr
    for key in SAME:
        assert woven.get(key) == plain.get(key), (key, woven.result, plain.result)
    assert woven.get("losses") == plain.get("losses")
    data = json.loads(Path(str(report).format(rank=0)).read_text())
    assert data["totals"]["woven"] == 0
    assert data["totals"]["modules"] == 10
    assert data["dynamo"]["recompiles"] == 0 and data["dynamo"]["recompile_limit_hits"] == []
    assert data["ac_fallbacks"]["count"] == 0
    assert data["swallowed"] == {}
    # stderr: plain's lines plus the exit summary of rank 0's report, nothing else.
    extra = list(_runner.normalised_stderr(woven))
    for line in _runner.normalised_stderr(plain):
        assert line in extra, (line, woven.stderr)
        extra.remove(line)
    summary = [line for line in woven.stderr.splitlines() if "autoweave report" in line]
    assert len(summary) == 1, woven.stderr
    assert all(not line.startswith("autoweave[") for line in extra), extra
