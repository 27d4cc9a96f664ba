"""A checkpoint in a branch that does not run now never makes the plan worse.

The model-zoo pattern ``if self.gradient_checkpointing and self.training: return
checkpoint(...)`` with the flag off used to switch a selective-AC block to "own forward
eager, children compiled one by one": its glue ran uncompiled and outside any checkpoint,
holding far more activations than plain torch (issue 19: 7.88 MB against 1.05 MB).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import autoweave
from autoweave.planning import planner
from tests.break_models import fsdp_like
from tests.models import saved_bytes

DIM = 64


pytestmark = pytest.mark.usefixtures("weave_on")


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.experts = fsdp_like(nn.Linear(DIM, DIM))
        self.out = nn.Linear(DIM, DIM)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.attn(x))
        return h + self.out(torch.relu(self.experts(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Zoo(Plain):
    """The flag as an instance attribute, read with ``self.training``."""

    def __init__(self) -> None:
        super().__init__()
        self.gradient_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and self.training:
            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class ClassFlag(Plain):
    """The flag as a class attribute, alone in the test."""

    use_checkpoint = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_checkpoint:
            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class Config:
    """A model config, as transformers keeps one (a plain object, not a module)."""

    def __init__(self) -> None:
        self.use_checkpoint = False


class ConfigFlag(Plain):
    """The flag on an object the module holds (``self.config.use_checkpoint``), issue 41 item 8."""

    def __init__(self) -> None:
        super().__init__()
        self.config = Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.use_checkpoint and self.training:
            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


def _save_nothing(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective(module: nn.Module) -> nn.Module:
    return checkpoint_wrapper(
        module, context_fn=functools.partial(create_selective_checkpoint_contexts, _save_nothing)
    )


def test_a_dormant_branch_is_not_read_as_a_checkpoint_and_an_active_one_is() -> None:
    zoo = Zoo()
    assert not planner.calls_checkpoint(zoo)
    zoo.gradient_checkpointing = True
    assert planner.calls_checkpoint(zoo)
    zoo.eval()  # train()/eval() flip at every call site: self.training is never taken as fixed
    assert planner.calls_checkpoint(zoo)
    flag = ClassFlag()
    assert not planner.calls_checkpoint(flag)
    flag.use_checkpoint = True
    assert planner.calls_checkpoint(flag)
    held = ConfigFlag()
    assert not planner.calls_checkpoint(held)
    held.config.use_checkpoint = True
    assert planner.calls_checkpoint(held)


@pytest.mark.parametrize("cls", [Zoo, ClassFlag, ConfigFlag])
def test_a_dormant_branch_plans_and_holds_what_the_block_without_it_does(cls: type) -> None:
    torch.manual_seed(0)
    dormant = _selective(cls())
    torch.manual_seed(0)
    branchless = _selective(Plain())
    assert [(d.path, d.action) for d in autoweave.plan(dormant).decisions] == [
        (d.path, d.action) for d in autoweave.plan(branchless).decisions
    ]
    x = torch.randn(512, DIM, requires_grad=True)
    compiled_dormant = torch.compile(dormant, backend="aot_eager")
    compiled_branchless = torch.compile(branchless, backend="aot_eager")
    for model in (compiled_dormant, compiled_branchless):
        saved_bytes(model, x)  # the first calls compile (and learn the break)
        saved_bytes(model, x)
    assert saved_bytes(compiled_dormant, x) == saved_bytes(compiled_branchless, x)
    torch.testing.assert_close(compiled_dormant(x), compiled_branchless(x))
