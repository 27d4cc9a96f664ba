"""What makes two blocks one kind: sharers of a compiled region or of a measured memory verdict.

A memory verdict is measured through a block's region (its pieces) and kept for every block of
its kind; blocks that a region would keep apart (another buffer, a hook of their own) must not
share one verdict either: a verdict measured on one would stand, unmeasured, for the other.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

from autoweave import _compat, _state
from autoweave.planning import kinds, learned
from tests import break_models as bm

DIM = 16
POLICY = bm.POLICIES["save-matmuls"]


@pytest.fixture(autouse=True)
def _fresh() -> None:
    _state.reset()
    yield
    _state.reset()


def _block() -> torch.nn.Module:
    torch.manual_seed(0)
    return cw.checkpoint_wrapper(bm.GlueGemmBlock(DIM, fsdp=False), context_fn=POLICY)


def _doubled(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output * 2


def test_a_verdict_is_shared_by_twins_and_not_by_blocks_with_another_buffer_or_hook() -> None:
    measured, twin, buffered, hooked, hooked_too = (_block() for _ in range(5))
    buffered._checkpoint_wrapped_module.register_buffer("scale", torch.ones(DIM))
    hooked._checkpoint_wrapped_module.norm2.register_forward_hook(_doubled)
    hooked_too._checkpoint_wrapped_module.norm2.register_forward_hook(_doubled)
    verdict = learned.Verdict(held=4096, eager_sac=1024)
    learned.learn_verdict(measured, verdict)
    assert learned.verdict_of(twin) is verdict
    assert learned.verdict_of(buffered) is None
    assert learned.verdict_of(hooked) is None
    learned.learn_verdict(hooked, verdict)
    assert learned.verdict_of(hooked_too) is verdict  # the same hook: one kind again


def test_the_memory_kind_is_the_region_kind_less_only_its_dtypes() -> None:
    # Derived from one value: blocks one region holds share a memory verdict, and the memory
    # kind drops only the dtypes (FSDP2's mixed precision swaps them between plan and measure).
    a, b = _block(), _block()
    b.to(torch.bfloat16)
    kind_a, kind_b = (
        kinds.block_kind(m._checkpoint_wrapped_module, _compat.modules.checkpoint_fn(m)) for m in (a, b)
    )
    assert kind_a != kind_b
    assert kind_a.memory() == kind_b.memory() == learned.kind(a) == learned.kind(b)
    c = _block()
    assert kind_a == kinds.block_kind(c._checkpoint_wrapped_module, _compat.modules.checkpoint_fn(c))
