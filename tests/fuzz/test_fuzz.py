"""The differential fuzzer's fixed seeds: each drawn model trains under autoweave as under plain torch.

``tests/fuzz/grammar.py`` draws the models, ``tests/fuzz/differential.py`` runs
and compares them (docs/guarantees.md lists what is compared). The fast lane
runs ``FAST_SEEDS``; the long run is ``python -m tests.fuzz --cases 500``.
A failure names its seed: ``python -m tests.fuzz --seed N`` runs that case alone.
"""

from __future__ import annotations

import pytest

from tests.fuzz import differential

pytestmark = pytest.mark.usefixtures("weave_on")

FAST_SEEDS = range(20)


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_a_drawn_model_trains_as_under_plain_torch(seed: int) -> None:
    case, found = differential.check(seed)
    assert not found, f"seed {seed}: {case.describe()}\n" + "\n".join(found)


@pytest.mark.slow
def test_the_long_run_runs_its_cases_in_fresh_processes(tmp_path) -> None:
    # A process slows down case after case (dynamo's compiled-graph globals stay): the long run
    # starts a fresh one every --per-process cases, and still reports every case once.
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run.json"
    seeds = ["--seed", "30842", "--seed", "30844", "--seed", "30847"]
    command = [sys.executable, "-m", "tests.fuzz", *seeds, "--per-process", "2", "--json", str(out)]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2]
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["seed"] for r in results] == [30842, 30844, 30847]
    assert len({r["pid"] for r in results[:2]}) == 1 and results[2]["pid"] != results[0]["pid"]
    assert proc.stdout.count("cases in") == 1  # one summary, the whole run's
