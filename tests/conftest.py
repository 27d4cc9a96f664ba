from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# -- autoweave on, dynamo and autoweave's state fresh (the in-process tests) -----------------
# Imported here, after the path is set, so a test run from any directory finds the checkout.
import pytest  # noqa: E402
import torch  # noqa: E402

import autoweave  # noqa: E402
from autoweave import _state  # noqa: E402


@pytest.fixture
def weave_on():
    torch._dynamo.reset()
    _state.reset()
    assert autoweave.enable()
    yield
    autoweave.disable()
    _state.reset()
    torch._dynamo.reset()
