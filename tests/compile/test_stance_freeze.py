"""``set_stance("fail_on_recompile")`` after warm-up, then blocks frozen: as plain torch (issue 41, item 5).

Staged or LoRA-style fine-tuning freezes blocks after a warm-up, often with the stance set
to catch recompiles. Plain torch runs a checkpointed block with a graph break eager (dynamo
gives up on the checkpoint), so freezing it recompiles nothing and the run trains. Woven, the
block's regions are compiled graphs that guard on ``requires_grad``: the freeze needs a
recompile, which the stance turns into an error. A woven region exists only because autoweave
wove it, so a frame of it that would recompile runs eager for that call instead, under the
block's checkpoint (a ``pieces`` block gets its checkpoint back for the call, as under
``force_eager``). A block plain torch compiles too (no break: the ``plain`` action) still
raises, at the same step, as plain torch does.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import autoweave
from tests import break_models as bm

pytestmark = pytest.mark.usefixtures("weave_on")

WARM, STEPS = 3, 6
FROZEN = (1, 2)


def _freeze(model: nn.Module, which: str) -> None:
    for i in FROZEN:
        block = model[i]
        # "block": every parameter; "after-break": only the projection after the experts'
        # break (the region's first frame still fits its graph, the resumed frame does not).
        params = block.parameters() if which == "block" else block.get_submodule(_OUT).parameters()
        for p in params:
            p.requires_grad_(False)


_OUT = "_orig_mod._checkpoint_wrapped_module.out"
_EXPERTS = "_orig_mod._checkpoint_wrapped_module.experts"


_RAN: list[nn.Module] = []  # the experts whose hooks ran, forward and recompute alike


def _ran(module: nn.Module, args: tuple) -> None:
    _RAN.append(module)


def _make(breaks: bool) -> nn.Module:
    block = bm.PlainMoE()
    if breaks:
        bm.fsdp_like(block.experts)
        # Counts the recompute: eager (disabled, as the FSDP-like hook is), it runs again in
        # backward under an eager checkpoint, as in plain torch, and not in a recompute that
        # runs inside a pieces block's graphs.
        block.experts.register_forward_pre_hook(torch.compiler.disable(_ran))
    return block


def _run(
    ac: str, which: str, breaks: bool, plain: bool, strategy: str = "auto"
) -> tuple[list, BaseException | None, int]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = [_make(breaks) for _ in range(4)]
    x = torch.randn(4, bm.DIM)
    with autoweave.disabled() if plain else contextlib.nullcontext():
        wrapped = [autoweave.set_mode(bm.with_ac(b, ac), strategy=strategy) for b in blocks]
        model = nn.Sequential(*(torch.compile(w, backend="aot_eager") for w in wrapped))
    experts = [block.get_submodule(_EXPERTS) for block in model]
    seen: list = []
    step = 0
    try:
        for step in range(STEPS):
            if step == WARM:
                torch.compiler.set_stance("fail_on_recompile")
                _freeze(model, which)
            _RAN.clear()
            loss = model(x).square().mean()
            loss.backward()
            grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            grads["hook runs"] = [sum(m is e for m in _RAN) for e in experts]
            seen.append((loss.detach(), grads))
            model.zero_grad(set_to_none=True)
    except Exception as error:  # compared with plain torch's, type and step
        return seen, error, step
    finally:
        torch.compiler.set_stance("default")
    return seen, None, STEPS


def _assert_same(plain: list, woven: list, *, frozen_eager: bool = False) -> None:
    assert len(woven) == len(plain)
    for step, ((p_loss, p_grads), (w_loss, w_grads)) in enumerate(zip(plain, woven, strict=True)):
        p_runs, w_runs = p_grads.pop("hook runs"), w_grads.pop("hook runs")
        if step >= WARM and frozen_eager:
            # The frozen blocks ran eager under their checkpoint: forward and recompute.
            assert [w_runs[i] for i in FROZEN] == [p_runs[i] for i in FROZEN] == [2, 2], step
        torch.testing.assert_close(w_loss, p_loss, rtol=1e-6, atol=1e-7, msg=f"loss step {step}")
        assert [n for n, g in w_grads.items() if g is None] == [n for n, g in p_grads.items() if g is None], (
            step
        )
        for name, grad in p_grads.items():
            if grad is not None:
                torch.testing.assert_close(
                    w_grads[name], grad, rtol=1e-6, atol=1e-7, msg=f"{name} step {step}"
                )


@pytest.mark.parametrize("which", ["block", "after-break"])
@pytest.mark.parametrize(
    ("ac", "strategy"),
    [("full", "auto"), ("selective", "auto"), ("selective", "pieces")],
    ids=["full", "selective", "selective-pieces"],
)
def test_frozen_blocks_train_where_plain_torch_trains(ac, strategy, which, capsys):
    plain, plain_error, _ = _run(ac, which, breaks=True, plain=True, strategy=strategy)
    assert plain_error is None, plain_error  # the case itself: plain torch runs these blocks eager
    capsys.readouterr()
    woven, error, step = _run(ac, which, breaks=True, plain=False, strategy=strategy)
    assert error is None, f"step {step}: {error!r}"
    # Said once: a refused recompile runs the block eager (a performance cost the stance hides).
    if which == "block":
        assert "[fail-on-recompile]" in capsys.readouterr().err
    _assert_same(plain, woven, frozen_eager=which == "block")
    assert woven[-1][1][f"1.{_OUT}.weight"] is None  # frozen: no grad, as in plain torch


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_a_block_plain_torch_compiles_still_raises(ac):
    # No break: the block is compiled as plain torch compiles it, and the stance is the user's.
    plain, plain_error, plain_step = _run(ac, "block", breaks=False, plain=True)
    woven, error, step = _run(ac, "block", breaks=False, plain=False)
    assert plain_error is not None and "fail_on_recompile" in str(plain_error)
    assert type(error) is type(plain_error) and step == plain_step == WARM
    _assert_same(plain, woven)


class _Model(nn.Module):
    """Glue around a loop over checkpointed blocks with a break, compiled whole."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(bm.DIM, bm.DIM)
        self.blocks = nn.ModuleList(bm.with_ac(_make(breaks=True), "full") for _ in range(3))
        self.head = nn.Linear(bm.DIM, bm.DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _run_whole(frozen: str, plain: bool) -> tuple[list, BaseException | None]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(4, bm.DIM)
    with autoweave.disabled() if plain else contextlib.nullcontext():
        compiled = torch.compile(model, backend="aot_eager")
    seen: list = []
    try:
        for step in range(STEPS):
            if step == WARM:
                torch.compiler.set_stance("fail_on_recompile")
                for p in model.get_submodule(frozen).parameters():
                    p.requires_grad_(False)
            loss = compiled(x).square().mean()
            loss.backward()
            grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            seen.append((loss.detach(), {**grads, "hook runs": []}))
            model.zero_grad(set_to_none=True)
    except Exception as error:
        return seen, error
    finally:
        torch.compiler.set_stance("default")
    return seen, None


@pytest.mark.parametrize("frozen", ["head", "blocks.1"])
def test_a_whole_model_compile_trains_where_plain_torch_trains(frozen):
    # Plain torch breaks in the loop over the blocks, and dynamo then runs the model's own
    # frame eager: the glue autoweave compiles as a region never recompiles there either.
    plain, plain_error = _run_whole(frozen, plain=True)
    assert plain_error is None, plain_error
    woven, error = _run_whole(frozen, plain=False)
    assert error is None, repr(error)
    _assert_same(plain, woven)
