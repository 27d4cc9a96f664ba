"""Backends autoweave hands dynamo (a woven region's, the report's counting of a plain compile) look like
the backend they hold: its name and its set-up hook."""

from __future__ import annotations

import pytest
import torch

from autoweave import _compat
from autoweave.observe import report
from autoweave.weave.pieces import RegionBackend


def _backend(gm, example_inputs):  # pragma: no cover - never compiled here
    return gm.forward


def _init() -> None:  # pragma: no cover - never called here
    return None


_backend._dynamo_backend_init = _init  # torch 2.15+: dynamo runs it at torch.compile()


@pytest.mark.parametrize(
    "wrap",
    [
        lambda inner: RegionBackend(inner, "region"),
        lambda inner: report._CountingPlain(report._Stats(None), "region", inner),
    ],
    ids=["region-backend", "report-counting-plain"],
)
def test_a_wrapped_backend_keeps_its_name_and_set_up_hook(wrap) -> None:
    wrapped = wrap(_backend)
    assert wrapped.__name__ == "_backend"
    assert wrapped._dynamo_backend_init is _init
    assert wrap(lambda gm, inputs: gm)._dynamo_backend_init is None


def test_plain_counting_wrappers_compare_equal_when_their_backends_do() -> None:
    # Per-layer plain compiles of one block share their graphs with the report on (dynamo matches ==).
    stats = report._Stats(None)
    wrapped, again = report._CountingPlain(stats, "a", _backend), report._CountingPlain(stats, "b", _backend)
    assert isinstance(wrapped, _compat.backends.BackendWrapper)
    assert wrapped == again and hash(wrapped) == hash(again)


def test_region_backends_are_equal_when_they_compile_alike() -> None:
    # Identical blocks share one backend object by construction (one per region key). Backends of
    # different regions compare equal when they compile alike, as torch's own wrappers do: a class
    # forward traced as a frame of its own is reached from every layer's region.
    a, b = RegionBackend(_backend, "a"), RegionBackend(_backend, "b")
    assert a == b and hash(a) == hash(b)
    assert RegionBackend(_backend, "a") != RegionBackend(lambda gm, inputs: gm, "a")
    # A pieces backend checkpoints its graphs its own way: equal to itself only.
    pieces = RegionBackend(_backend, "p", checkpoint_fn=torch.utils.checkpoint.checkpoint)
    assert (
        pieces == pieces
        and pieces != a
        and pieces != RegionBackend(_backend, "p", torch.utils.checkpoint.checkpoint)
    )
