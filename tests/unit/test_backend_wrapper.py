"""Backends autoweave wraps (the report's counting, the fail-open guard) look like the backend they wrap."""

from __future__ import annotations

import pytest

from autoweave import _compat
from autoweave._failopen import GraphGuard
from autoweave.observe import report


def _backend(gm, example_inputs):  # pragma: no cover - never compiled here
    return gm.forward


def _init() -> None:  # pragma: no cover - never called here
    return None


_backend._dynamo_backend_init = _init  # torch 2.15+: dynamo runs it at torch.compile()


@pytest.mark.parametrize(
    "wrap",
    [
        lambda inner: GraphGuard(inner, "region"),
        lambda inner: report._Counting(report._Stats(None), report.RegionStats("region", "woven"), inner),
    ],
    ids=["graph-guard", "report-counting"],
)
def test_a_wrapped_backend_keeps_its_name_equality_and_set_up_hook(wrap) -> None:
    wrapped, again = wrap(_backend), wrap(_backend)
    assert isinstance(wrapped, _compat.BackendWrapper)
    assert wrapped == again and hash(wrapped) == hash(again)  # dynamo matches cached graphs with ==
    assert wrapped.__name__ == "_backend"
    assert wrapped._dynamo_backend_init is _init
    assert wrap(lambda gm, inputs: gm)._dynamo_backend_init is None
