"""A region's graph inductor fails on under autotuning is compiled untuned, with no warning (issue 41 item 8).

On an H200 (torch 2.11), ``torch.compile(checkpoint_wrapper(layer), mode="max-autotune-no-cudagraphs")``
over transformers' Qwen3-MoE with the experts in their own FSDP2 unit: inductor raised on the
experts' region and autoweave ran the region eager with a ``[region-eager]`` warning, where plain
torch (the checkpointed layer eager, as dynamo falls back) prints nothing. Here inductor's failure
under autotuning is simulated (``compile_fx`` raises ``InductorError`` when ``max_autotune`` is on,
and compiles as ``aot_eager`` otherwise, so no C++ is built): every graph compiles untuned, nothing
runs eager, nothing is written to stderr, and the plan summary and the report say it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave._state import run
from tests.break_models import PlainMoE, fsdp_like

DIM = 8
pytestmark = [pytest.mark.usefixtures("weave_on"), pytest.mark.fail_open]


def _block() -> nn.Module:
    block = PlainMoE(DIM)  # norm, experts, out: the experts an FSDP-like unit, a real graph break
    fsdp_like(block.experts)
    return cw.checkpoint_wrapper(block)


@pytest.fixture
def autotuning_fails(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """inductor's ``compile_fx``, failing under autotuning and compiling as ``aot_eager`` otherwise."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch._inductor import compile_fx
    from torch._inductor.exc import InductorError

    tuned: list[bool] = []

    def fake_compile_fx(model: torch.fx.GraphModule, inputs: list, **kwargs: object) -> object:
        patches = kwargs.get("config_patches") or {}
        tuned.append(bool(patches.get("max_autotune")))  # type: ignore[union-attr]
        if tuned[-1]:
            raise InductorError(RuntimeError("no valid choice for a template (simulated)"), None)
        return aot_eager(model, inputs)

    monkeypatch.setattr(compile_fx, "compile_fx", fake_compile_fx)
    return tuned


def _train(plain: bool, mode: str | None, strategy: str = "auto") -> list[float]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = [_block() for _ in range(2)]
    x = torch.randn(4, DIM)
    with autoweave.disabled() if plain else contextlib.nullcontext():
        if not plain:
            for block in blocks:
                autoweave.set_mode(block, strategy=strategy)
        model = nn.Sequential(*(torch.compile(b, mode=mode) for b in blocks))
    losses = []
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("strategy", ["hoist", "pieces"])
def test_a_graph_inductor_fails_on_under_autotuning_compiles_untuned_with_no_warning(
    autotuning_fails: list[bool], capsys: pytest.CaptureFixture[str], strategy: str
) -> None:
    plain = _train(plain=True, mode="max-autotune-no-cudagraphs")
    assert not capsys.readouterr().err  # plain torch: the checkpointed blocks eager, silently
    woven = _train(plain=False, mode="max-autotune-no-cudagraphs", strategy=strategy)
    assert woven == pytest.approx(plain, rel=1e-6)
    assert "autoweave" not in capsys.readouterr().err  # no [region-eager], no [graph-eager]
    assert True in autotuning_fails and False in autotuning_fails  # tried tuned, then compiled untuned
    assert run.region_graphs and all(eager == 0 for _, eager in run.region_graphs.values())
    assert run.swallowed.get("graph-untuned", 0) >= 1 and set(run.swallowed) == {"graph-untuned"}
    notes = [note for notes in run.region_notes.values() for note in notes]
    assert any("without autotuning" in note for note in notes)


def test_without_autotuning_a_failure_is_not_retried(autotuning_fails: list[bool]) -> None:
    _train(plain=False, mode=None)
    assert autotuning_fails and not any(autotuning_fails)  # compiled once each, untuned as asked
    assert "graph-untuned" not in run.swallowed
