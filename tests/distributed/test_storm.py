"""DDP and ``replicate`` on 2 ranks (gloo) over compiled, checkpointed blocks with a ``.item()``
router, ``self.calls += 1`` and a counting hook: the recompile storm of issue 41 (item 7) settles,
and every step trains as plain torch. The worker is ``storm_worker.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed import torchrun

WORKER = Path(__file__).with_name("storm_worker.py")
WARM_UP = 6  # steps: the trial, the first woven call, then STORM_CALLS compiling calls per block


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("storm") / "results.json"
    proc = torchrun(WORKER, str(out), timeout=900)
    return json.loads(out.read_text()), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["ddp", "replicate"])
def test_a_recompile_storm_under_data_parallel_settles_and_trains_as_plain_torch(ranks, wrap: str) -> None:
    results, stderr = ranks
    plain, woven = results[f"{wrap}:off"], results[f"{wrap}:on"]
    assert plain["error"] is None and woven["error"] is None, (plain["error"], woven["error"])
    assert woven["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert woven["none"] == plain["none"]  # grad is None where plain's is, at every step
    for a, b in zip(plain["grads"], woven["grads"], strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
    # After warm-up, no rank converts a frame plain torch does not (plain: none after step 0).
    assert woven["frames"][WARM_UP:] == plain["frames"][WARM_UP:] == [0] * (len(plain["frames"]) - WARM_UP)
    # Settled by the region's watchdog (eager under its checkpoint, as plain torch runs it), with
    # a warning naming the region and the frame that recompiled, before dynamo's limit (before
    # the watchdog: 74 frames converted in steps 0-5 and the limit warning on every rank).
    settled = [line for line in stderr.splitlines() if "[steady-state] woven region autoweave_Block" in line]
    assert settled and "[recompile-limit]" not in stderr, stderr[-3000:]
