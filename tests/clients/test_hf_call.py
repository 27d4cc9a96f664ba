"""transformers <= 5.22 (layers checkpoint around ``nn.Module.__call__``), HF gradient checkpointing,
the experts an FSDP2 unit inside each layer's, 2 gloo ranks (issue 41, item 4).

Worker: ``tests/clients/hf_call_worker.py``. The lane runs this file with transformers 5.22.2 first
on ``PYTHONPATH`` (``.ci/clients``); with a newer transformers it skips. Per layer (each layer
``.compile()``: the checkpoint lies outside the compile, nothing falls back, nothing to weave) and
whole model (``torch.compile(model)``: plain torch's layers fall back to eager, autoweave weaves
them): autoweave trains with plain torch's losses and, after warm-up, converts no frame plain torch
does not (transformers 5.0-5.22 re-planned at every step before issue 41's fix).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runner  # noqa: E402

pytestmark = pytest.mark.clients
WORKER = "hf_call_worker"


@pytest.fixture(scope="module", autouse=True)
def _needs_transformers_5_22():
    _runner.require("transformers")
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    if (major, minor) > (5, 22):
        pytest.skip(f"transformers {transformers.__version__} checkpoints in forward; this needs <= 5.22")


@pytest.mark.parametrize("form", ["layer", "whole"])
def test_a_checkpoint_around_call_trains_as_plain_and_settles(client_run, form):
    plain = client_run(WORKER, "plain", "--compile", form)
    woven = client_run(WORKER, "autoweave", "--compile", form)
    for run in (plain, woven):
        assert run.ok, run.describe()
    assert woven.get("autoweave_active") and not plain.get("autoweave_active")
    assert woven.get("transformers", "").startswith("5.22")
    assert woven.get("losses") == pytest.approx(plain.get("losses"), rel=1e-5)
    # After warm-up nothing converts a frame plain torch does not (plain: none).
    assert woven.get("steady_frames") <= plain.get("steady_frames") == 0, (woven.get("frames_per_step"),)
    assert woven.get("recompile_limit_hits") == 0
