"""At dynamo's recompile limit, a call is told apart before it runs: does an entry's guard fit it?

A woven block under an eager checkpoint runs its compiled code twice, in forward and in
recompute. Left to dynamo, a call that fits none of its code's entries at the limit runs that
frame eager, and the frames it calls run whatever entries they hold at that moment; other
blocks may compile more before the recompute, which then runs other graphs than its forward
(``CheckpointError``; fuzzer seed 2243, ``tests/fuzz/test_regressions.py``). autoweave answers
"no entry fits, at the limit" from the entries' guards before the call, and runs such a call
eager with dynamo off below it, in forward and recompute alike.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch

from autoweave._compat import regions


def _make() -> tuple:
    scale = 2.0

    def region(module: torch.nn.Module, x: torch.Tensor, bias: int = 1) -> torch.Tensor:
        return module(x) * scale + bias  # a closure cell and a default: both among the frame's locals

    return region


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


LINEAR = torch.nn.Linear(4, 4)


def test_a_call_no_entry_fits_is_told_only_at_the_limit() -> None:
    region, linear = _make(), LINEAR
    compiled = torch.compile(region, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        compiled(linear, torch.randn(2, 4))
        # One entry: below the limit, dynamo would compile a new one.
        assert not regions._no_entry_at_limit(region, (linear, torch.randn(3, 4)), {}, None)
        compiled(linear, torch.randn(3, 4))
        # Two entries, at the limit: a third shape fits neither, the first two each fit one.
        assert regions._no_entry_at_limit(region, (linear, torch.randn(5, 4)), {}, None)
        assert not regions._no_entry_at_limit(region, (linear, torch.randn(2, 4)), {}, None)
        assert not regions._no_entry_at_limit(region, (linear, torch.randn(3, 4)), {}, None)
        # The default is bound as the frame sees it: a value the entries specialized on differs.
        assert regions._no_entry_at_limit(region, (linear, torch.randn(2, 4)), {"bias": 3}, None)
    # A limit given with the compile (``recompile_limit=``) is the one that counts.
    assert not regions._no_entry_at_limit(region, (linear, torch.randn(5, 4)), {}, 8)


def test_a_decorators_frame_is_read_with_its_own_arguments() -> None:
    # A wrapper made with functools.wraps: the frame dynamo converts is the wrapper's, with its
    # own ``*args`` (not the signature ``inspect`` would follow ``__wrapped__`` to).
    inner, linear = _make(), LINEAR

    @functools.wraps(inner)
    def computing(module: torch.nn.Module, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return inner(module, x * 0.5, *args, **kwargs) * 2.0

    compiled = torch.compile(computing, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled(linear, torch.randn(2, 4))
        assert not regions._no_entry_at_limit(computing, (linear, torch.randn(2, 4)), {}, None)
        assert regions._no_entry_at_limit(computing, (linear, torch.randn(3, 4)), {}, None)


def test_an_argument_that_does_not_bind_leaves_the_call_to_dynamo() -> None:
    region = _make()
    compiled = torch.compile(region, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled(LINEAR, torch.randn(2, 4))
        assert not regions._no_entry_at_limit(region, (LINEAR,), {"nope": 1}, None)
