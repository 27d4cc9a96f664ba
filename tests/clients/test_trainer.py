"""transformers 5.24's Trainer, ``torch_compile=True`` + ``gradient_checkpointing=True`` on the CPU, one process.

Worker: ``tests/clients/trainer_worker.py``. With no graph break inside a layer there is
nothing to weave: autoweave must capture exactly what plain torch does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runner  # noqa: E402

pytestmark = pytest.mark.clients
WORKER = "trainer_worker"


@pytest.fixture(scope="module", autouse=True)
def _needs_transformers():
    _runner.require("transformers")
    _runner.require("accelerate")


def test_trainer_compile_is_the_same_with_autoweave(client_run):
    plain = client_run(WORKER, "plain", nproc=1)
    woven = client_run(WORKER, "autoweave", nproc=1)
    eager = client_run(WORKER, "plain", "--eager", nproc=1)
    for run in (plain, woven, eager):
        assert run.ok, run.describe()
    assert plain.get("compiled") == woven.get("compiled") == "OptimizedModule"
    for key in ("graphs", "ops", "compiles", "recompiles", "unique_graphs", "fallbacks", "graph_breaks"):
        assert woven.get(key) == plain.get(key), (key, woven.result, plain.result)
    assert woven.get("fwd_gemms_eager") == plain.get("fwd_gemms_eager") == 0
    assert _runner.max_rel_diff(woven.get("losses"), eager.get("losses")) < 1e-4
    assert _runner.max_rel_diff(plain.get("losses"), eager.get("losses")) < 1e-4
