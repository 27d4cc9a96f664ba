"""prime-rl's wrapping order (AC per layer, then in-place compile, then FSDP2 on router, experts, layer, model).

Worker: ``tests/clients/primerl_worker.py`` (tiny Qwen3-MoE, fp32, 2 gloo ranks; no prime-rl package).
The router's and the experts' units sit under each layer's checkpoint, inside the compiled wrapper:
plain dynamo falls back to eager for every layer. The capture limit is the ``lm_head``'s one forward
GEMM (outside every compiled layer).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runner  # noqa: E402

pytestmark = pytest.mark.clients
WORKER = "primerl_worker"
LIMIT = 1  # the lm_head's GEMM: no compiled module holds it


@pytest.fixture(scope="module", autouse=True)
def _needs_transformers():
    _runner.require("transformers")


@pytest.mark.parametrize("layers", [2, 8])
def test_primerl_order_keeps_the_layers_compiled(client_run, layers):
    plain = client_run(WORKER, "plain", "--layers", str(layers))
    woven = client_run(WORKER, "autoweave", "--layers", str(layers))
    for run in (plain, woven):
        assert run.ok, run.describe()
    assert woven.get("autoweave_active") and not plain.get("autoweave_active")
    # prime-rl's units: router and experts inside each layer's (the compiled checkpoint wrapper's)
    inner = "_checkpoint_wrapped_module.mlp"
    expected = {
        f"model.layers.{i}{suffix}"
        for i in range(layers)
        for suffix in ("", f".{inner}.gate", f".{inner}.experts")
    }
    assert expected <= set(woven.get("units")), woven.get("units")
    assert plain.get("fallbacks") >= 1
    assert plain.get("fwd_gemms_eager") > LIMIT, plain.result
    assert woven.get("fallbacks") == 0, woven.describe()
    assert woven.get("recompile_limit_hits") == 0
    assert woven.get("fwd_gemms_eager") == LIMIT, woven.result
    assert woven.get("fwd_gemms_eager") + woven.get("fwd_gemms_compiled") == plain.get("fwd_gemms_eager")
    assert _runner.max_rel_diff(woven.get("losses"), plain.get("losses")) <= 1e-5


def test_primerl_order_losses_equal_eager(client_run):
    woven = client_run(WORKER, "autoweave", "--layers", "2")
    eager = client_run(WORKER, "plain", "--layers", "2", "--no-compile")
    for run in (woven, eager):
        assert run.ok, run.describe()
    assert _runner.max_rel_diff(woven.get("losses"), eager.get("losses")) <= 1e-5


def test_primerl_order_frames_do_not_grow_with_depth(client_run):
    runs = {n: client_run(WORKER, "autoweave", "--layers", str(n)) for n in (2, 8)}
    for run in runs.values():
        assert run.ok, run.describe()
    frames = {n: run.get("frames") for n, run in runs.items()}
    compiles = {n: run.get("compiles") for n, run in runs.items()}
    assert frames[2] == frames[8], (frames, compiles)
    assert compiles[2] == compiles[8], (frames, compiles)
