"""A policy and a frozen reference model of one class in one process (RL), each block compiled
with ``isolate_recompiles=True``. Worker: ``tests/clients/policy_ref_worker.py`` (2 gloo ranks).

Plain torch loses every checkpointed MoE block of both models to the experts' FSDP unit; autoweave
compiles both to the limit (the output head, outside the compiled blocks), the reference's
``no_grad`` forward included, with plain's losses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runner  # noqa: E402

pytestmark = pytest.mark.clients
WORKER = "policy_ref_worker"


@pytest.mark.parametrize("isolate", [(), ("--no-isolate",)], ids=["isolate_recompiles", "shared-recompiles"])
def test_a_policy_and_its_frozen_reference_compile_to_the_limit(client_run, isolate):
    plain = client_run(WORKER, "plain", *isolate)
    woven = client_run(WORKER, "autoweave", *isolate)
    for run in (plain, woven):
        assert run.ok, run.describe()
    if not isolate:
        assert woven.get("isolate_recompiles") is True  # torch 2.13+: the lane's torch has it
    assert _runner.max_rel_diff(woven.get("losses"), plain.get("losses")) < 1e-5
    assert _runner.max_rel_diff(woven.get("ref_logp_sums"), plain.get("ref_logp_sums")) < 1e-5
    for key in ("fwd_gemms_eager", "ref_fwd_gemms_eager"):
        # The limit: the output head, which no compiled block holds. Plain runs the MoE blocks eager.
        assert woven.get(key) == 1, (key, woven.result)
        assert plain.get(key) > woven.get(key), (key, plain.result)
    assert woven.get("fallbacks") == 0 and plain.get("fallbacks") > 0
    assert woven.get("recompiles") <= plain.get("recompiles") + woven.get("frames"), woven.result
    assert woven.get("compiles_per_step")[1:] == [0] * (len(woven.get("compiles_per_step")) - 1)
