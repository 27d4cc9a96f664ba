"""A compiled block under an eager checkpoint meets the same inputs in its recompute as in its forward.

An eager checkpoint saves its inputs for the recompute; under the user's saved-tensor hooks
(``saved_tensors_hooks``, ``save_on_cpu``) autograd hands each back as a tensor of its own, never
a view, and dynamo guards a view input's base. A woven block whose input is a view then ran one
graph in forward and looked up none in the recompute: past the recompile limit that recompute
ran eager, and selective AC's recompute met ops its forward never stored (issue 31 item 2, on
FSDP2: "aten.add_.Scalar encountered during backward but not found in storage", from the eager
``rms_norm``). Plain torch runs such a block eager both times and trains.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import autoweave
from tests import break_models as bm

DIM = 16

pytestmark = pytest.mark.usefixtures("weave_on")


def _save_mm(ctx, op, *args, **kwargs):
    return (
        CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
    )


class NormBlock(nn.Module):
    """An RMSNorm (eager: ``add_``; compiled: ``add``) and a linear around experts that break as an FSDP unit."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.experts = bm.fsdp_like(bm.SimpleExperts(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(self.norm(x))
        return h + self.experts(h.reshape(-1, DIM)).reshape(h.shape)


class Model(nn.Module):
    def __init__(self, alike: bool = False, selective: bool = True) -> None:
        super().__init__()
        self.alike = alike
        self.embed = nn.Linear(DIM, DIM)
        sac = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _save_mm)}
        self.block = cw.checkpoint_wrapper(NormBlock(), **(sac if selective else {}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The block's input is a view: of a larger base (half of a wider tensor's last dim; a
        # linear's 3-D output is one on torch 2.13, not on 2.15), or ``alike`` its base (FSDP2's
        # hook outputs, ``view_as``).
        h = self.embed(x)
        return self.block((h + 0.0).view_as(h) if self.alike else torch.cat([h, h], dim=-1)[..., :DIM])


HOOKS = {
    "identity": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    "save_on_cpu": torch.autograd.graph.save_on_cpu,
}


def _train(model: nn.Module, hooks: str) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    # The second length recompiles the block with the length dynamic (its second and last graph
    # under a limit of 2); then steps whose forward runs under the user's hooks.
    for step, (length, hooked) in enumerate(((8, False), (6, False), (6, True), (10, True), (6, False))):
        x = torch.randn(2, length, DIM, generator=torch.Generator().manual_seed(step))
        with HOOKS[hooks]() if hooked else contextlib.nullcontext():
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.fail_open  # dynamo's recompile-limit warning is part of the scenario
@pytest.mark.parametrize("strategy", ["auto", "hoist", "pieces"])
@pytest.mark.parametrize("hooks", sorted(HOOKS))
def test_a_forward_under_saved_tensors_hooks_trains_as_plain_torch(strategy: str, hooks: str) -> None:
    torch.manual_seed(0)
    model = Model()
    plain = copy.deepcopy(model)
    with autoweave.disabled():
        plain.block = torch.compile(plain.block, backend="aot_eager")
    model.block = torch.compile(autoweave.set_mode(model.block, strategy=strategy), backend="aot_eager")
    with torch._dynamo.config.patch(recompile_limit=2):
        want = _train(plain, hooks)
        got = _train(model, hooks)
    assert got == pytest.approx(want, rel=1e-6), (got, want)


def _unviewed_dims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The dims of the tensors autoweave gives as non-views from now on, in order."""
    from autoweave._compat import checkpoints

    given: list[int] = []
    unviewed = checkpoints._unviewed()
    monkeypatch.setattr(checkpoints, "_unviewed", lambda: lambda t: given.append(t.dim()) or unviewed(t))
    return given


def _woven_and_plain(alike: bool, selective: bool = True) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = Model(alike, selective)
    # Marked, the experts are a region of their own (a unit that breaks only in its hooks would be
    # traced in the block's region, its input never crossing a region's entry: nested graph breaks).
    autoweave.boundary(model.block._checkpoint_wrapped_module.experts)
    plain = copy.deepcopy(model)
    with autoweave.disabled():
        plain.block = torch.compile(plain.block, backend="aot_eager")
    model.block = torch.compile(autoweave.set_mode(model.block, strategy="hoist"), backend="aot_eager")
    return model, plain


@pytest.mark.parametrize("alike", [False, True], ids=["view-of-a-larger-base", "alike-view"])
@pytest.mark.parametrize("hooks", [None, "identity"])
def test_a_view_input_takes_one_form_hooks_or_none(
    hooks: str | None, alike: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block's view input meets the same guards every step, in forward and recompute alike.

    A view alike its base (FSDP2's) passes as it is, with no op; the recompute that gets a tensor
    of its own in its place (under hooks) gets ``view_as`` of it. A view of a larger base (the
    linear's output here) is given as a non-view in both, every step: under hooks its recompute
    meets a tensor of its own, and a step under hooks would otherwise compile every frame once
    more (fuzzer seed 60709). Views made inside the checkpoint (the experts' flat input, FSDP2's
    hook outputs) are given as non-views too.
    """
    given = _unviewed_dims(monkeypatch)
    model, plain = _woven_and_plain(alike)
    for net in (plain, model):
        for step in range(3):
            x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(step))
            with HOOKS[hooks]() if hooks else contextlib.nullcontext():
                loss = net(x).square().mean()
            # The recompute takes its forward's answer, whatever hooks the backward runs under.
            with HOOKS["identity"]() if not hooks else contextlib.nullcontext():
                loss.backward()
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)
    # The experts' input (2-D, made inside) in forward and recompute at every step; the block's
    # input (3-D, the checkpoint's own) too unless alike its base, but in a recompute under hooks,
    # which meets a tensor of its own.
    assert given.count(2) == 6, given
    assert given.count(3) == (0 if alike else 3 if hooks else 6), given


@pytest.mark.parametrize("alike", [False, True], ids=["view-of-a-larger-base", "alike-view"])
def test_a_step_under_saved_tensor_hooks_compiles_nothing_more(alike: bool) -> None:
    """After warm-up, a forward under the user's saved-tensor hooks meets the graphs of the steps before.

    dynamo guards a view input's base where its sizes are dynamic (``L['x']._base.size()[0]``):
    a length the second step made dynamic, a view in one step and a non-view in another meet
    other guards (fuzzer seed 60709: every frame compiled once more at the hooked step).
    """
    from torch._dynamo.utils import counters

    model, _ = _woven_and_plain(alike)
    converted = []
    for step, (length, hooked) in enumerate(((8, False), (6, False), (10, True), (7, False))):
        x = torch.randn(2, length, DIM, generator=torch.Generator().manual_seed(step))
        with HOOKS["identity"]() if hooked else contextlib.nullcontext():
            loss = model(x).square().mean()
        loss.backward()
        converted.append(counters["frames"]["ok"])
    assert converted[1:] == [converted[1]] * 3, converted


@pytest.mark.parametrize("hooks", [None, "save_on_cpu"])
def test_a_graph_kept_for_a_second_backward_is_recomputed_with_the_same_forms(hooks: str | None) -> None:
    """``retain_graph``: each backward recomputes the checkpoint, each meeting its forward's view forms.

    Under ``save_on_cpu`` the recompute gets a tensor of its own where its forward passed an alike
    view, and ``view_as`` of it: read per recompute, not used up by the first (a second that met a
    non-view would look up, and here compile, another graph than its forward's). Full AC:
    selective AC allows one backward of a region, and a compiled backward that donates its buffers
    none kept (off here).
    """
    from torch._dynamo.utils import counters

    model, plain = _woven_and_plain(alike=True, selective=False)
    second = []  # frames the second backward of each step converted
    with torch._functorch.config.patch(donated_buffer=False):
        for net in (plain, model):
            for step, length in enumerate((8, 6, 7)):
                x = torch.randn(2, length, DIM, generator=torch.Generator().manual_seed(step))
                with HOOKS[hooks]() if hooks else contextlib.nullcontext():
                    loss = net(x).square().mean()
                loss.backward(retain_graph=True)
                before = counters["frames"]["ok"]
                loss.backward()
                second.append(counters["frames"]["ok"] - before)
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)
    assert second == [0] * 6, second
