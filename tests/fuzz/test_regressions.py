"""What the differential fuzzer found, each as a named case (issue 31): it trains as under plain torch."""

from __future__ import annotations

import pytest

from tests.fuzz import differential
from tests.fuzz.grammar import Case

pytestmark = pytest.mark.usefixtures("weave_on")

# Selective AC over a block with a `.item()` break, whole-model compile, lengths varying: a
# float made a tensor makes dynamo restart its analysis from inside the backend of a piece.
ITEM_BREAK_UNDER_SAC = Case(
    seed=0,
    layers=2,
    value_type="str",
    value_place="private",
    values_differ=True,
    brk="item",
    break_at="middle",
    ac="selective-matmuls",
    form="torch.compile(model)",
    fullgraph=False,
    strategy="auto",
    decorator="none",
    lengths="varying",
    recompile_limit=None,
    steps=3,
    events=(),
)


def _differences(case: Case) -> list[str]:
    plain = differential.run(case, on=False)
    woven = differential.run(case, on=True)
    return differential.differences(
        case, plain, woven, differential.run(differential.bound_of(case), on=False)
    )


def test_a_dynamo_restart_inside_a_pieces_backend_is_dynamos_to_act_on() -> None:
    # Swallowed as [piece-eager], the piece ran eager where dynamo would have compiled it.
    assert _differences(ITEM_BREAK_UNDER_SAC) == []
