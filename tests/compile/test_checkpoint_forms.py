"""Checkpoints written the newer ways: torch 2.15's decorator, and transformers' layers.

- torch 2.15: ``@checkpoint(use_reentrant=False)`` on a ``forward`` (a ``_CheckpointedFunction``).
  Plain ``torch.compile`` of such a module fails in its first backward (dynamo compiles the
  decorated function as a frame of its own and the recompute runs it eager: ``CheckpointError``),
  break or no break; with autoweave it compiles, with eager's gradients and AC's memory.
- transformers 5.0-5.22 checkpoint in a layer's ``__call__``, 5.23+ in its ``forward``. The lane
  decides which is installed (the first CI lane has 5.24, the 2.15 lane 5.22); both are planned
  so that a per-layer compile keeps the layer compiled around the experts' break.
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import autoweave
from autoweave import _compat, _instances
from autoweave.dispatch import dispatchers
from autoweave.weave import keep_checkpoint
from benchmarks.measure import forward_gemms_outside_graphs
from tests.break_models import fsdp_like
from tests.models import saved_bytes

ROOT = Path(__file__).resolve().parents[2]
BACKEND = "aot_eager"
DIM = 64

decorator_form = pytest.mark.skipif(
    _compat.checkpoints.checkpointed_function_class() is None,
    reason="checkpoint's decorator form is torch 2.15+",
)


pytestmark = pytest.mark.usefixtures("weave_on")


def _save_matmuls(ctx, op, *args, **kwargs):
    gemms = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in gemms else CheckpointPolicy.PREFER_RECOMPUTE


def _selective():
    return create_selective_checkpoint_contexts(_save_matmuls)


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(DIM, 4 * DIM)
        self.v = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v(torch.relu(self.w(x)))


class Block(nn.Module):
    def __init__(self, fsdp: bool) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.experts = Experts()
        self.out = nn.Linear(DIM, DIM)
        if fsdp:
            fsdp_like(self.experts)

    def body(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = x + torch.tanh(self.attn(x)) * scale
        return h + self.out(torch.relu(self.experts(h)))


if _compat.checkpoints.checkpointed_function_class() is not None:

    class FullAC(Block):
        forward = checkpoint(use_reentrant=False)(Block.body)

    class SelectiveAC(Block):
        forward = checkpoint(use_reentrant=False, context_fn=_selective)(Block.body)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@decorator_form
@pytest.mark.parametrize("fsdp", [False, True], ids=["no-break", "fsdp-break"])
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_a_forward_decorated_with_checkpoint_compiles_and_trains_as_eager(ac: str, fsdp: bool) -> None:
    torch.manual_seed(0)
    model = (FullAC if ac == "full" else SelectiveAC)(fsdp)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=BACKEND)
    x = torch.randn(32, DIM, requires_grad=True)
    for _ in range(3):
        compiled(x).sum().backward()  # plain torch 2.15: CheckpointError here, at the first backward
        eager(x).sum().backward()
    for got, want in zip(_grads(model), _grads(eager), strict=True):
        torch.testing.assert_close(got, want)
    assert forward_gemms_outside_graphs(compiled, x) == 0
    assert set(model.state_dict()) == set(eager.state_dict())


@decorator_form
def test_the_decorated_checkpoint_still_saves_what_ac_saves() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, DIM, requires_grad=True)
    decorated = torch.compile(FullAC(fsdp=False), backend=BACKEND)
    undecorated = Block(fsdp=False)
    undecorated.forward = undecorated.body
    no_ac = torch.compile(undecorated, backend=BACKEND)
    saved_bytes(decorated, x), saved_bytes(no_ac, x)  # compile first
    # The checkpoint is traced: the compiled graph keeps its inputs, not its activations.
    assert saved_bytes(decorated, x) < 0.5 * saved_bytes(no_ac, x)


@decorator_form
def test_an_instance_decorated_forward_and_its_keyword_arguments_are_kept_and_shed_by_a_copy() -> None:
    torch.manual_seed(0)
    model = Block(fsdp=True)
    model.forward = checkpoint(use_reentrant=False)(model.body)
    decorated = model.forward
    eager = copy.deepcopy(model)
    x = torch.randn(8, DIM, requires_grad=True)
    # A keyword argument reaches the forward, never checkpoint's own options.
    keep_checkpoint.make_traceable(model)
    torch.testing.assert_close(model(x, scale=0.5), eager(x, scale=0.5))
    assert keep_checkpoint.make_traceable(model) == 0  # idempotent: already in the call form
    # A copy is what plain torch would copy: the user's decorated forward, no stand-in.
    copied = copy.deepcopy(model)
    assert set(copied.__dict__) == set(eager.__dict__) and not _instances.stands_in(copied.forward)
    assert type(copied.forward) is type(decorated)
    plain_class = SelectiveAC(fsdp=False)
    keep_checkpoint.make_traceable(plain_class)
    assert "forward" not in copy.deepcopy(plain_class).__dict__


_LOAD_WITHOUT_AUTOWEAVE = """
import sys
sys.modules["autoweave"] = None  # any import of autoweave's code while loading fails
import torch
model = torch.load(sys.argv[1], weights_only=False)
x = torch.randn(4, {dim}, requires_grad=True)
model(x).sum().backward()
print(type(model).__name__, "forward" in model.__dict__)
"""


@decorator_form
@pytest.mark.parametrize("when", ["compiled", "woven"])
def test_a_model_saved_after_the_decorator_rewrite_loads_without_autoweave(tmp_path, when) -> None:
    from tests import decorated_models

    model = decorated_models.DecoratedBlock()
    compiled = torch.compile(model, backend=BACKEND)
    assert _instances.stands_in(model.__dict__.get("forward"))  # the call form stands in
    if when == "woven":
        x = torch.randn(4, decorated_models.DIM, requires_grad=True)
        compiled(x).sum().backward()
        assert dispatchers.dispatcher_of(compiled).woven
    path = tmp_path / "model.pt"
    torch.save(model, path)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE")}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_AUTOWEAVE.format(dim=decorated_models.DIM), str(path)],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [
        "DecoratedBlock",
        "False",
    ]  # the class's decorated forward, as saved by torch


# -- transformers -------------------------------------------------------------------------


def _tiny_qwen3_moe(layers: int = 2) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for layer in model.model.layers:
        fsdp_like(layer.mlp.experts)  # the experts as their own FSDP unit: a graph break
    return model


def _hf_run(in_place: bool, weave: bool) -> tuple[list[float], int]:
    model = _tiny_qwen3_moe()
    layers = model.model.layers
    with autoweave.disabled() if not weave else contextlib.nullcontext():
        for i, layer in enumerate(layers):
            if in_place:
                layer.compile(backend=BACKEND)
            else:
                layers[i] = torch.compile(layer, backend=BACKEND)
    return _train(model)


def _train(model: nn.Module) -> tuple[list[float], int]:
    """Three steps' losses, then the forward GEMMs run outside compiled graphs."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.item())
    return losses, forward_gemms_outside_graphs(model, ids)


def _checkpoints_in_forward() -> bool:
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return (major, minor) >= (5, 23)


@pytest.mark.slow
def test_transformers_layers_are_found_where_their_version_checkpoints() -> None:
    from autoweave.planning import checkpoint_calls, planner

    layer = _tiny_qwen3_moe(layers=1).model.layers[0]
    in_call = checkpoint_calls.call_checkpoints(layer)
    in_forward = planner.calls_checkpoint(layer)
    assert (in_call, in_forward) == ((False, True) if _checkpoints_in_forward() else (True, False))


@pytest.mark.slow
@pytest.mark.parametrize("in_place", [False, True], ids=["torch.compile(layer)", "layer.compile()"])
def test_transformers_layers_compile_around_the_experts_break(in_place: bool) -> None:
    eager_losses, all_gemms = _train(_tiny_qwen3_moe())
    torch._dynamo.reset()
    plain_losses, plain_gemms = _hf_run(in_place, weave=False)
    torch._dynamo.reset()
    woven_losses, woven_gemms = _hf_run(in_place, weave=True)
    assert plain_losses == pytest.approx(eager_losses, rel=1e-5)
    assert woven_losses == pytest.approx(eager_losses, rel=1e-5)
    assert woven_gemms <= plain_gemms
    if not in_place or _checkpoints_in_forward():
        # torch.compile(layer) traces the checkpoint, so plain torch loses the whole layer
        # (and 5.23+'s forward checkpoint is traced by layer.compile() too).
        assert plain_gemms == all_gemms and woven_gemms < plain_gemms
    if _checkpoints_in_forward():
        # 5.24's experts compile: only the lm_head runs outside compiled graphs (the limit).
        assert woven_gemms == 1


def _whole_model_run(units: bool, in_place: bool, weave: bool) -> tuple[list[float], int]:
    """Whole-model compile; ``units``: each layer an FSDP unit too, as transformers' native FSDP2 makes.

    Returns three steps' losses and the forward GEMMs run outside compiled graphs in the
    steady state (the second call without labels: the first compiles for the new arguments).
    """
    model = _tiny_qwen3_moe()
    if units:
        for layer in model.model.layers:
            fsdp_like(layer)
    with autoweave.disabled() if not weave else contextlib.nullcontext():
        if in_place:
            model.compile(backend=BACKEND)
            compiled = model
        else:
            compiled = torch.compile(model, backend=BACKEND)
    losses, _ = _train(compiled)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return losses, forward_gemms_outside_graphs(compiled, ids)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("units", "in_place"),
    [(True, False), (True, True), (False, False)],
    ids=["layers-as-units-torch.compile(model)", "layers-as-units-model.compile()", "torch.compile(model)"],
)
def test_a_whole_model_compile_keeps_checkpointing_layers_that_hold_a_unit_compiled(
    units: bool, in_place: bool
) -> None:
    # Issue 32: a layer that is an FSDP unit and checkpoints in its own forward (HF's
    # GradientCheckpointingLayer) was planned as a region split at its nested units; its
    # checkpoint was traced and dynamo ran the layer eager (13 of 31 forward GEMMs).
    eager_losses, _ = _train(_tiny_qwen3_moe())
    torch._dynamo.reset()
    plain_losses, plain_gemms = _whole_model_run(units, in_place, weave=False)
    torch._dynamo.reset()
    woven_losses, woven_gemms = _whole_model_run(units, in_place, weave=True)
    assert plain_losses == pytest.approx(eager_losses, rel=1e-5)
    assert woven_losses == pytest.approx(eager_losses, rel=1e-5)
    assert plain_gemms > 0 and woven_gemms < plain_gemms, (plain_gemms, woven_gemms)
    if _checkpoints_in_forward():
        assert woven_gemms == 0, woven_gemms  # the limit: every module is under the compile


@pytest.mark.slow
def test_a_whole_model_compile_traces_nothing_after_warm_up() -> None:
    # Issue 41 item 4: on transformers <= 5.22 (the checkpoint around ``__call__``) the woven
    # whole model fell back at every call, re-planned and re-traced 5 frames per step forever.
    from tests.compile.test_steady_state import frames_and_losses

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    runs = []
    for weave in (False, True):
        torch._dynamo.reset()
        model = _tiny_qwen3_moe()
        with autoweave.disabled() if not weave else contextlib.nullcontext():
            compiled = torch.compile(model, backend=BACKEND)
        runs.append(frames_and_losses(lambda x, c=compiled: c(input_ids=x, labels=x).logits, ids, steps=6))
    (plain_frames, plain_losses), (woven_frames, woven_losses) = runs
    assert woven_losses == pytest.approx(plain_losses, rel=1e-5)
    assert sum(woven_frames[2:]) <= sum(plain_frames[2:]), (plain_frames, woven_frames)


@pytest.mark.slow
@pytest.mark.fail_open
@pytest.mark.parametrize("whole", [False, True], ids=["per-layer", "whole-model"])
def test_transformers_5_0_grouped_mm_experts_train_where_dynamo_cannot_trace_them(whole: bool) -> None:
    # Issue 41 item 6: 5.0's grouped_mm experts fail dynamo's fake-tensor check on CPU in fp32.
    # The region degraded ([region-eager]) but dynamo's skip covered its own frame only: in the
    # backward's recompute a frame below it was converted again, outside the first call's
    # fail-open, and raised (whole model), where plain torch trains.
    transformers = pytest.importorskip("transformers")
    if not transformers.__version__.startswith("5.0."):
        pytest.skip("needs transformers 5.0 (its grouped_mm experts have no CPU fallback)")
    runs = []
    for weave in (False, True):
        torch._dynamo.reset()
        model = _tiny_qwen3_moe()
        with autoweave.disabled() if not weave else contextlib.nullcontext():
            if whole:
                model = torch.compile(model, backend=BACKEND)
            else:
                for i, layer in enumerate(model.model.layers):
                    model.model.layers[i] = torch.compile(layer, backend=BACKEND)
        runs.append(_train(model)[0])
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)
