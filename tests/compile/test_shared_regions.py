"""Identical blocks share compiled code under every strategy (issue 20): one region per kind of region."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import autoweave
from autoweave.dispatch import dispatchers
from autoweave.observe import counting
from tests.break_models import Stack, save_matmuls
from tests.models import Block

pytestmark = pytest.mark.usefixtures("weave_on")


def _selective(block):
    # A partial per block, as recipes build them: equal by value, not by identity.
    return cw.checkpoint_wrapper(
        block, context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls)
    )


def _compiled(depth: int, strategy: str) -> tuple[int, int]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack([_selective(Block()) for _ in range(depth)], dim=8)
    autoweave.set_mode(model, strategy=strategy)
    cap = counting.Capture()
    compiled = torch.compile(model, backend=cap.backend())
    for _ in range(2):
        compiled(torch.randn(4, 8)).square().mean().backward()
    labels = set(dispatchers.dispatcher_of(compiled)._applied.regions.values())
    return len(labels), cap.graph_count


@pytest.mark.parametrize("strategy", ["pieces", "hoist"])
def test_identical_blocks_share_regions_and_graphs(strategy: str) -> None:
    shallow = _compiled(2, strategy)
    deep = _compiled(6, strategy)
    assert deep == shallow, (strategy, shallow, deep)  # labels and compiled graphs flat in depth
