"""The differential fuzzer's fixed seeds: each drawn model trains under autoweave as under plain torch.

``tests/fuzz/grammar.py`` draws the models, ``tests/fuzz/differential.py`` runs
and compares them (docs/guarantees.md lists what is compared). The fast lane
runs ``FAST_SEEDS``; the long run is ``python -m tests.fuzz --cases 500``.
A failure names its seed: ``python -m tests.fuzz --seed N`` runs that case alone.
"""

from __future__ import annotations

import pytest

from tests.fuzz import differential

pytestmark = pytest.mark.usefixtures("weave_on")

FAST_SEEDS = range(20)


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_a_drawn_model_trains_as_under_plain_torch(seed: int) -> None:
    case, found = differential.check(seed)
    assert not found, f"seed {seed}: {case.describe()}\n" + "\n".join(found)
