"""accelerate 1.15 (FSDP2 plugin + TorchDynamoPlugin) with transformers 5.24's Qwen3-MoE, 2 gloo ranks.

Worker: ``tests/clients/accelerate_worker.py``. Compared: plain torch (``AUTOWEAVE`` unset),
autoweave (``AUTOWEAVE=1``, default settings) and eager (no dynamo plugin).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _runner  # noqa: E402

pytestmark = pytest.mark.clients
WORKER = "accelerate_worker"


@pytest.fixture(scope="module", autouse=True)
def _needs_accelerate():
    _runner.require("accelerate")
    _runner.require("transformers")


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("accelerate-save")


def _regional(client_run, setting, save_dir):
    return client_run(WORKER, setting, "--layers", "3", "--measure", "--save", str(save_dir / setting))


def _eager(client_run, save_dir):
    return client_run(
        WORKER, "plain", "--layers", "3", "--compile", "none", "--save", str(save_dir / "eager")
    )


def test_regional_compile_weaves_around_the_experts_unit(client_run, save_dir):
    plain = _regional(client_run, "plain", save_dir)
    woven = _regional(client_run, "autoweave", save_dir)
    eager = _eager(client_run, save_dir)
    for run in (plain, woven, eager):
        assert run.ok, run.describe()
    assert woven.get("autoweave_active") and not plain.get("autoweave_active")
    # Plain torch: the experts' FSDP hooks break the graph under each layer's checkpoint, so the
    # whole checkpointed layer falls back to eager; autoweave compiles around the unit.
    assert plain.get("fallbacks") >= 1
    assert woven.get("fallbacks") == 0, woven.describe()
    assert plain.get("fwd_gemms_eager") >= 30
    assert woven.get("fwd_gemms_eager") <= 1, woven.describe()
    assert woven.get("recompile_limit_hits") == 0
    assert _runner.max_rel_diff(woven.get("losses"), eager.get("losses")) < 1e-4
    assert _runner.max_rel_diff(plain.get("losses"), eager.get("losses")) < 1e-4


def test_saved_checkpoint_is_the_same_with_and_without_autoweave(client_run, save_dir):
    torch = pytest.importorskip("torch")
    runs = {s: _regional(client_run, s, save_dir) for s in ("plain", "autoweave")}
    runs["eager"] = _eager(client_run, save_dir)
    for run in runs.values():
        assert run.ok, run.describe()
    states = {s: torch.load(save_dir / s / "model.pt", weights_only=True) for s in runs}
    assert sorted(states["autoweave"]) == sorted(states["plain"]) == sorted(states["eager"])
    assert len(states["plain"]) == runs["plain"].get("saved_keys") > 0
    for key, value in states["plain"].items():
        assert type(value) is torch.Tensor, key  # a full state dict, gathered by accelerate
        for other in ("autoweave", "eager"):
            got = states[other][key]
            assert got.shape == value.shape and got.dtype == value.dtype, (other, key)
            assert torch.allclose(got, value, rtol=1e-4, atol=1e-6), (
                other,
                key,
                (got - value).abs().max().item(),
            )


def test_ten_layers_autoweave_trains_when_plain_does(client_run):
    plain = client_run(WORKER, "plain", "--layers", "10", "--steps", "1")
    assert plain.ok, plain.describe()
    woven = client_run(WORKER, "autoweave", "--layers", "10", "--steps", "1")
    assert woven.ok, woven.describe()
    assert woven.get("fallbacks") == 0
    assert _runner.max_rel_diff(woven.get("losses"), plain.get("losses")) < 1e-4


def test_no_grad_forward_first_autoweave_trains_when_plain_does(client_run):
    plain = client_run(WORKER, "plain", "--layers", "3", "--steps", "1", "--nograd")
    assert plain.ok, plain.describe()
    woven = client_run(WORKER, "autoweave", "--layers", "3", "--steps", "1", "--nograd")
    assert woven.ok, woven.describe()
    assert _runner.max_rel_diff(woven.get("losses"), plain.get("losses")) < 1e-4


def test_whole_model_compile(client_run):
    plain = client_run(WORKER, "plain", "--layers", "3", "--compile", "whole")
    woven = client_run(WORKER, "autoweave", "--layers", "3", "--compile", "whole")
    assert plain.ok, plain.describe()
    assert woven.ok, woven.describe()
    assert woven.get("fallbacks") == 0, woven.describe()
    assert woven.get("recompile_limit_hits") == 0
    assert _runner.max_rel_diff(woven.get("losses"), plain.get("losses")) < 1e-4


def _version(run) -> tuple[int, ...]:
    return tuple(int(part) for part in run.get("accelerate").split(".")[:2])


@pytest.mark.parametrize("variant", ["accelerate", "eager_layers"], ids=["layers+experts", "layers-only"])
def test_what_accelerate_nests_is_woven_and_nothing_else(client_run, variant):
    """Both pins (1.15 in the lane's venv, 1.16 through ``.ci/clients``'s second pass).

    Experts named in the wrap policy nest a unit in every layer on both versions: plain loses
    every layer, autoweave compiles to the limit (the lm_head). With the layers alone, 1.15 puts
    the layer's unit inside its checkpoint wrapper (plain loses it; autoweave weaves), while 1.16
    shards the wrapper: nothing nests, and autoweave must be a true no-op.
    """
    args = ("--layers", "3", "--gemms", "--variant", variant)
    plain = client_run(WORKER, "plain", *args)
    woven = client_run(WORKER, "autoweave", *args)
    for run in (plain, woven):
        assert run.ok, run.describe()
        # .ci/clients names the version each pass must have run (the second pass puts 1.16 first on PYTHONPATH).
        assert run.get("accelerate") == os.environ.get("CLIENTS_ACCELERATE", run.get("accelerate"))
    assert _runner.max_rel_diff(woven.get("losses"), plain.get("losses")) < 1e-5
    all_gemms = plain.get("fwd_gemms_eager") + plain.get("fwd_gemms_compiled")
    if variant == "eager_layers" and _version(plain) >= (1, 16):
        for key in ("graphs", "ops", "compiles", "recompiles", "frames", "fallbacks", "graph_breaks"):
            assert woven.get(key) == plain.get(key), (key, woven.result, plain.result)
        assert woven.get("fwd_gemms_eager") == plain.get("fwd_gemms_eager") == 1
        return
    assert plain.get("fallbacks") == 1 and plain.get("fwd_gemms_eager") == all_gemms
    assert woven.get("fallbacks") == 0 and woven.get("fwd_gemms_eager") == 1
