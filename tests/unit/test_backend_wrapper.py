"""The backend autoweave hands dynamo for a woven region looks like the backend it holds: its name and its
set-up hook."""

from __future__ import annotations

import torch

from autoweave.weave.pieces import RegionBackend


def _backend(gm, example_inputs):  # pragma: no cover - never compiled here
    return gm.forward


def _init() -> None:  # pragma: no cover - never called here
    return None


_backend._dynamo_backend_init = _init  # torch 2.15+: dynamo runs it at torch.compile()


def test_a_wrapped_backend_keeps_its_name_and_set_up_hook() -> None:
    wrapped = RegionBackend(_backend, "region")
    assert wrapped.__name__ == "_backend"
    assert wrapped._dynamo_backend_init is _init
    assert RegionBackend(lambda gm, inputs: gm, "region")._dynamo_backend_init is None


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
