"""Every rank makes the same decisions when ranks see different data (issue 31, item 9).

Ranks that plan a block differently run different code around its FSDP hooks and can order their
collectives differently: a hang. The worker (``ranks_worker.py``) trains gloo FSDP2 on two ranks,
rank 0 on short sequences and rank 1 on long ones, where two decisions hang on the length a rank
saw: the first-call memory verdict (pieces or hoist) and a break only a long sequence takes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.distributed import torchrun

WORKER = Path(__file__).resolve().parent / "ranks_worker.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    torchrun(WORKER, str(out), timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_ranks_plan_alike(ranks: list[dict]) -> None:
    # After every step, every block's dispatcher state and plan are the same on both ranks.
    for step, (zero, one) in enumerate(zip(ranks[0]["decisions"], ranks[1]["decisions"], strict=True)):
        assert zero == one, f"step {step}: rank 0 {zero} != rank 1 {one}"
    last = ranks[0]["decisions"][-1]
    # What one rank saw decides for all: rank 1's pieces held more than eager SAC (hoist), and
    # only rank 1's long sequences broke the LongBreakBlocks (woven on both ranks).
    assert [[action for _, action in actions] for _, actions in last[:2]] == [["hoist", "split"]] * 2
    assert [state for state, _ in last[2:]] == ["woven", "woven"]


@pytest.mark.slow
def test_ranks_train_as_plain_torch(ranks: list[dict]) -> None:
    for rank in ranks:
        assert len(rank["woven"]) == len(rank["plain"]) == 4
        for woven, plain in zip(rank["woven"], rank["plain"], strict=True):
            assert math.isclose(woven, plain, rel_tol=1e-5, abs_tol=1e-6), (rank["woven"], rank["plain"])
