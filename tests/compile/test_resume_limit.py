"""At dynamo's recompile limit in a frame resumed after a break, forward and recompute run alike (issue 41, item 2).

A checkpointed block with a ``.item()`` break is woven; dynamo resumes after the break in a
``torch_dynamo_resume_in_...`` frame. Something after the break makes that frame recompile on
every call (``self.calls += 1``, which dynamo specializes on; a forward hook appending to a
list). A recompute sees another value than its forward, so it needs an entry of its own: at the
limit, dynamo ran that frame eager in the recompute while its forward had run a graph
(``CheckpointError``, or silently other gradients for the layers before the break). autoweave
decides for the whole region at its entry: once any of its frames is at the limit, the region
runs eager under its checkpoint, forward and recompute alike, as plain torch runs it.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import autoweave
from tests import break_models as bm

DIM = 8
LIMIT = 4
STEPS = 8  # the resume frames reach the limit at step 4 (2 blocks, forward and recompute)
pytestmark = pytest.mark.usefixtures("weave_on")


class RouterBlock(nn.Module):
    """norm -> router -> ``.item()`` on a statistic -> more linears; after the break, ``counts``."""

    def __init__(self, counts: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, 4)
        self.up = nn.Linear(DIM, 16)
        self.down = nn.Linear(16, DIM)
        self.counts = counts
        self.calls = 0
        self.seen: list[int] = []
        if counts == "hook":
            self.down.register_forward_hook(lambda module, args, out: self.seen.append(out.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        scores = self.router(h).softmax(-1)
        load = scores.max().item()  # a graph break: dynamo resumes below in a frame of its own
        if self.counts == "calls":
            self.calls += 1  # an int attribute dynamo guards on: a new entry per call
        y = self.down(torch.relu(self.up(h * scores.sum(-1, keepdim=True))))
        return x + y * (1.0 + 0.0 * load)


def _ac(block: nn.Module, ac: str) -> nn.Module:
    if ac == "selective":
        return cw.checkpoint_wrapper(
            block, context_fn=functools.partial(create_selective_checkpoint_contexts, bm.save_matmuls)
        )
    return cw.checkpoint_wrapper(block)


def _train(counts: str, ac: str, plain: bool, train: bool) -> list[tuple[float, dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    blocks = [RouterBlock(counts) for _ in range(2)]
    x = torch.randn(4, DIM)
    torch._dynamo.reset()
    with autoweave.disabled() if plain else contextlib.nullcontext():
        model = nn.Sequential(*(torch.compile(_ac(b, ac), backend="aot_eager") for b in blocks))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(STEPS):
        loss = model(x).square().mean()
        loss.backward()
        seen.append(
            (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
        if train:  # else every step's gradients are taken at the same weights
            opt.step()
        opt.zero_grad(set_to_none=True)
    return seen


@pytest.mark.parametrize(
    ("counts", "ac", "train"),
    [
        ("calls", "full", False),
        ("calls", "selective", False),
        ("hook", "full", False),
        ("hook", "selective", False),
        ("calls", "full", True),
    ],
    ids=["self.calls+=1-full", "self.calls+=1-selective", "hook-full", "hook-selective", "self.calls+=1-sgd"],
)
def test_losses_and_grads_equal_plain_torch_through_the_limit(counts, ac, train, capfd):
    with torch._dynamo.config.patch(recompile_limit=LIMIT):
        plain = _train(counts, ac, plain=True, train=train)
        capfd.readouterr()
        woven = _train(counts, ac, plain=False, train=train)
    for step, ((p_loss, p_grads), (w_loss, w_grads)) in enumerate(zip(plain, woven, strict=True)):
        assert w_loss == pytest.approx(p_loss, rel=1e-6), step
        assert sorted(w_grads) == sorted(p_grads), step
        for name, grad in p_grads.items():
            torch.testing.assert_close(w_grads[name], grad, rtol=1e-6, atol=1e-7, msg=f"{name} step {step}")
    # The case itself: a frame resumed after the break recompiled at every call. It settled,
    # at the limit or by the region's watchdog (first where each recompute meets its forward's
    # `self.calls`), with a warning that names the region and that frame, not another strategy.
    err = capfd.readouterr().err.splitlines()
    said = [line for line in err if "[recompile-limit]" in line or "[steady-state]" in line]
    assert said, err
    assert all("(frame torch_dynamo_resume_in_autoweave_RouterBlock" in line for line in said), said
    assert not any("pieces" in line for line in said), said


class HelperBlock(nn.Module):
    """``forward`` calls a helper with the break (``self.ffn(h)``, as blocks write it); after
    the break the helper reads ``self.scale``, which the trainer changes now and then."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, DIM)
        self.down = nn.Linear(DIM, DIM)
        self.scale = 1

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        if h.detach().sum().item() > 1e9:  # a graph break: the helper resumes in a frame of its own
            h = h * 2
        return self.down(h) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(torch.relu(self.up(x)))


def test_a_helper_frame_recompiling_now_and_then_stops_at_the_limit(capfd):
    # Seed 32442's class: a helper a block calls at a break is a frame of its own, outside the
    # region's own and resume frames. Before, its entries grew past the user's limit (dynamo's
    # was raised in the woven call), one every few steps (too rarely for the watchdog): 9 frames
    # converted by step 23, and growing. Now it counts at the region's entry: eager from the limit.
    def train(plain: bool) -> tuple[list[float], list[int]]:
        torch.manual_seed(0)
        block = HelperBlock()
        torch._dynamo.reset()
        with autoweave.disabled() if plain else contextlib.nullcontext():
            model = torch.compile(cw.checkpoint_wrapper(block), backend="aot_eager")
        losses, frames = [], []
        for step in range(20):
            if step % 5 == 0:
                block.scale = step + 1  # a new guarded value every fifth step
            loss = model(torch.randn(4, DIM, generator=torch.Generator().manual_seed(step))).square().mean()
            loss.backward()
            losses.append(loss.item())
            frames.append(torch._dynamo.utils.counters["frames"]["total"])
        return losses, frames

    with torch._dynamo.config.patch(recompile_limit=2):
        plain, _ = train(plain=True)
        losses, frames = train(plain=False)
    assert losses == pytest.approx(plain, rel=1e-6)
    assert frames[-1] == frames[4], frames  # nothing converted after the limit was met
    said = [line for line in capfd.readouterr().err.splitlines() if "[recompile-limit]" in line]
    assert len(said) == 1 and "(frame torch_dynamo_resume_in_ffn" in said[0], said


@pytest.mark.skipif(
    "recompile_limit" not in __import__("inspect").signature(torch.compile).parameters,
    reason="torch.compile takes no recompile_limit of its own before 2.13",
)
def test_a_recompile_limit_given_to_torch_compile_is_kept_at_the_entry_too():
    # torch 2.13+ checks a compile's own ``recompile_limit=`` in place of its config's. Given as
    # it was to the regions' compiles, the resume frame reached it mid-call: CheckpointError in
    # the first backward after the hook's list grew (limit 1). Now raised there as the config's
    # is, and kept at the region's entry.
    def train(plain: bool) -> list[float]:
        torch.manual_seed(0)
        blocks = [RouterBlock("hook") for _ in range(2)]
        x = torch.randn(4, DIM)
        torch._dynamo.reset()
        with autoweave.disabled() if plain else contextlib.nullcontext():
            model = nn.Sequential(
                *(
                    torch.compile(cw.checkpoint_wrapper(b), backend="aot_eager", recompile_limit=1)
                    for b in blocks
                )
            )
        seen = []
        for _ in range(STEPS):
            loss = model(x).square().mean()
            loss.backward()
            seen += [loss.item(), blocks[0].norm.weight.grad.sum().item()]
            model.zero_grad(set_to_none=True)
        return seen

    assert train(plain=False) == pytest.approx(train(plain=True), rel=1e-6)


@pytest.mark.fail_open
def test_a_failure_of_the_entry_decision_runs_the_region_eager_not_into_the_step(monkeypatch, capfd):
    # The decision reads dynamo's cache (``entry_counts``); a torch that keeps it another way
    # would raise there, in the user's step. Now the region runs eager from that call on, with
    # one warning, its forward and recompute alike: losses and gradients stay plain torch's.
    from autoweave._compat import backends

    plain = _train("calls", "full", plain=True, train=True)
    entry_counts = backends.entry_counts
    calls = [0]

    def failing(fn):
        calls[0] += 1
        if calls[0] > 3:  # after the first compiles: some calls' forwards decided, then none can
            raise RuntimeError("a cache read another way")
        return entry_counts(fn)

    monkeypatch.setattr(backends, "entry_counts", failing)
    capfd.readouterr()
    with torch._dynamo.config.patch(recompile_limit=LIMIT):
        woven = _train("calls", "full", plain=False, train=True)
    assert calls[0] > 3
    for step, ((p_loss, p_grads), (w_loss, w_grads)) in enumerate(zip(plain, woven, strict=True)):
        assert w_loss == pytest.approx(p_loss, rel=1e-6), step
        for name, grad in p_grads.items():
            torch.testing.assert_close(w_grads[name], grad, rtol=1e-6, atol=1e-7, msg=f"{name} step {step}")
    said = [line for line in capfd.readouterr().err.splitlines() if "entry of woven region" in line]
    assert len(said) == 1 and "[internal-error]" in said[0], said  # the first one, as every internal error
