"""Canaries: each dynamo message autoweave reacts to, provoked on the installed torch and read back.

autoweave hears dynamo only through log records (``autoweave/_compat/log_strings.py``
reads each into a typed message; ``autoweave/_taps.py`` listens). When a torch
release rewords one, the test for it fails here, on that torch's CI lane, naming
the message, instead of autoweave silently hearing nothing. Plain torch (autoweave
off), aot_eager, one process.
"""

from __future__ import annotations

import inspect
import logging
import threading

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _compat, _taps
from autoweave._compat.log_strings import Fallback, FallbackBreak, GraphBreak, RecompileLimit, WontConvert
from autoweave.planning import sources
from autoweave.sense import graph_breaks


@pytest.fixture(autouse=True)
def plain_torch():
    autoweave.disable()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _line(fn: object, needle: str) -> int:
    lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return first + next(i for i, line in enumerate(lines) if needle in line)


class _Breaking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x).relu()
        torch._dynamo.graph_break()  # the break the canaries look for
        return self.lin(x)


def _heard(kind: type, run: object) -> list:
    heard: list = []
    with _taps.listening(kind, heard.append):
        run()  # type: ignore[operator]
    return heard


def test_a_checkpoint_with_a_graph_break_falls_back_and_says_where() -> None:
    model = torch.compile(cw.checkpoint_wrapper(_Breaking()), backend="aot_eager")
    x = torch.randn(4, 8, requires_grad=True)
    fallbacks: list[Fallback] = []
    breaks: list[FallbackBreak] = []
    with _taps.listening(Fallback, fallbacks.append), _taps.listening(FallbackBreak, breaks.append):
        model(x).sum().backward()
    assert fallbacks, "dynamo's 'will fall back to eager-mode PyTorch' message was not read"
    assert all(_compat.log_strings.FALLBACK_NEEDLE in f.text for f in fallbacks)
    assert breaks, "the break dynamo logs after a fallback (with its user stack) was not read"
    where = sources.break_frames(breaks[0])
    assert where and (where[0].filename, where[0].lineno) == (
        __file__,
        _line(_Breaking.forward, "graph_break()"),
    )
    assert breaks[0].reason


def test_a_graph_break_record_carries_the_user_stack() -> None:
    def breaks_once(x: torch.Tensor) -> torch.Tensor:
        x = x.sin()
        torch._dynamo.graph_break()  # the graph-break record's innermost user frame
        return x.cos()

    heard = _heard(GraphBreak, lambda: torch.compile(breaks_once, backend="aot_eager")(torch.randn(4)))
    assert heard, "dynamo's graph_breaks record was not read"
    assert heard[0].reason and heard[0].frames
    assert graph_breaks.site_of(heard[0]) == f"{__file__}:{_line(breaks_once, 'graph_break()')}"
    assert not heard[0].in_checkpoint


def test_the_recompile_limit_warning_names_the_function() -> None:
    def specialized(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n

    compiled = torch.compile(specialized, backend="aot_eager", dynamic=False)

    def run() -> None:
        with torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
            for n in range(4):  # an int argument is specialized: one compile per value
                compiled(torch.randn(4), n)

    heard = _heard(RecompileLimit, run)
    assert heard, "dynamo's recompile-limit warning was not read"
    assert (
        "'specialized'" in heard[0].function
        and _compat.log_strings.RECOMPILE_LIMIT_NEEDLE in heard[0].summary
    )
    assert heard[0].code_name == "specialized" and heard[0].in_function("specialized")
    assert not heard[0].in_function("special")


def test_the_recompile_limit_of_a_resume_function_is_read_as_its_function() -> None:
    # A woven region's frame after a break is a resume function dynamo names after the region.
    def broken(x: torch.Tensor, n: int) -> torch.Tensor:
        x = x + 1
        torch._dynamo.graph_break()
        return x * n

    compiled = torch.compile(broken, backend="aot_eager", dynamic=False)

    def run() -> None:
        with torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
            for n in range(4):
                compiled(torch.randn(4), n)

    heard = _heard(RecompileLimit, run)
    resumed = [h for h in heard if h.code_name != "broken"]
    assert resumed and all(h.in_function("broken") for h in resumed), [h.code_name for h in heard]
    assert not any(h.in_function("broke") for h in heard)


def test_a_frame_dynamo_will_not_convert_is_read_with_its_error() -> None:
    class BackendFailed(RuntimeError):
        pass

    def failing_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        raise BackendFailed("a backend that fails on every graph")

    compiled = torch.compile(lambda x: x.sin() + 1, backend=failing_backend)

    def run() -> None:
        with _compat.dynamo.suppressing_errors() as suppressing:
            assert suppressing
            compiled(torch.randn(4))

    heard = _heard(WontConvert, run)
    assert heard, "dynamo's WON'T CONVERT warning was not read"
    assert heard[0].thread in (threading.get_ident(), None)
    error: BaseException | None = heard[0].error
    while error is not None and not isinstance(error, BackendFailed):  # dynamo wraps it
        error = error.__cause__ or error.__context__
    assert isinstance(error, BackendFailed)


def test_listening_leaves_dynamo_loggers_as_they_were() -> None:
    names = (
        _compat.log_strings.FALLBACK_LOGGER,
        _compat.log_strings.GRAPH_BREAK_LOGGER,
        _compat.log_strings.RECOMPILE_LIMIT_LOGGER,
    )
    loggers = [logging.getLogger(name) for name in names]
    taps = [_taps.tap(name) for name in names]
    assert not any(t in log.filters for t, log in zip(taps, loggers, strict=True)), (
        "an earlier listener leaked"
    )
    before = [(log.level, log.propagate, list(log.filters), list(log.handlers)) for log in loggers]
    with (
        _taps.listening(Fallback, list().append),
        _taps.listening(GraphBreak, list().append),
        _taps.listening(RecompileLimit, list().append),
    ):
        assert all(t in log.filters for t, log in zip(taps, loggers, strict=True))
    assert [(log.level, log.propagate, list(log.filters), list(log.handlers)) for log in loggers] == before
    assert not any("isEnabledFor" in vars(log) for log in loggers)
