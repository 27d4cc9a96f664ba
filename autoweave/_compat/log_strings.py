"""dynamo's log messages autoweave reacts to, each read in one place into a small typed record.

dynamo tells what autoweave must react to only in log records (a checkpoint
that fell back to eager, a frame past the recompile limit, a graph break's user
stack, a frame it would not convert). Each message class names the logger it
comes from and the level it is logged at; ``read`` turns one record into one
message, or None. ``autoweave._taps`` keeps one listener per logger and hands
these messages to whoever subscribed; nothing else matches dynamo's wording.

Torch range: the wording of 2.11-2.15 (``tests/compile/test_dynamo_messages.py``
provokes each message on the installed torch; ``version.self_check`` looks for
each needle in dynamo's source on a newer one). Upstream: no issue asks for a structured
event; the report to file is drafted in docs/upstream.md (U2).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from autoweave._compat import dynamo
from autoweave._compat.lookup import need_source

# Each logger is the module that logs, declared with the wording it must hold (``need_source``).
# "<checkpoint> ... will fall back to eager-mode PyTorch": a traced checkpoint gave up
# (``speculate_subgraph`` in torch/_dynamo/variables/higher_order_ops.py, at INFO); the
# ``Unsupported`` error that made it give up is logged next, as the record's message.
# TODO(docs/upstream.md U2, a report to file): read a structured fallback event instead.
FALLBACK_NEEDLE = "fall back to eager-mode PyTorch"
FALLBACK_LOGGER = need_source(
    f"dynamo's fallback message {FALLBACK_NEEDLE!r}",
    "torch._dynamo.variables.higher_order_ops",
    FALLBACK_NEEDLE,
)
# dynamo's warning when a frame's cache is full and it runs eager from then on
# ("torch._dynamo hit config.recompile_limit ...", torch/_dynamo/convert_frame.py).
RECOMPILE_LIMIT_NEEDLE = "hit config."
RECOMPILE_LIMIT_LOGGER = need_source(
    f"dynamo's recompile-limit message {RECOMPILE_LIMIT_NEEDLE!r}",
    "torch._dynamo.convert_frame",
    RECOMPILE_LIMIT_NEEDLE,
)
# dynamo's warning when it suppressed an error and runs the frame eager
# (``format_error_msg`` in torch/_dynamo/exc.py, logged by ``ConvertFrame.__call__``).
SUPPRESSED_NEEDLE = "WON'T CONVERT"
need_source(
    f"dynamo's suppressed-error message {SUPPRESSED_NEEDLE!r}", "torch._dynamo.exc", SUPPRESSED_NEEDLE
)
CONVERT_FRAME_LOGGER = RECOMPILE_LIMIT_LOGGER
# dynamo's graph-break artifact logger (``getArtifactLogger(__name__, "graph_breaks")`` in
# torch/_dynamo/symbolic_convert.py); one DEBUG record per graph break, with the user stack.
# A logger, not an attribute: its module is declared, holding the artifact's name.
_SYMBOLIC_CONVERT = need_source(
    "dynamo's graph_breaks log artifact", "torch._dynamo.symbolic_convert", '"graph_breaks"'
)
GRAPH_BREAK_LOGGER = f"{_SYMBOLIC_CONVERT}.__graph_breaks"
# The note dynamo adds to a break raised inside a checkpoint's body.
HOP_CHECKPOINT_NOTE = "Higher Order Operator: torch.utils.checkpoint"

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_AT = re.compile(r"in user code at (.+?):(\d+)")
_REASON = re.compile(r"Graph Break Reason: (.*)")
# The function line of the recompile-limit warning: ``function: 'name' (file:line)``.
_LIMIT_FUNCTION = re.compile(r"function: '([^']+)'")


@dataclass(frozen=True)
class Frame:
    """One frame of a user stack dynamo logged."""

    filename: str
    lineno: int
    name: str


@dataclass(frozen=True)
class Fallback:
    """A traced checkpoint fell back to eager: the whole checkpointed region runs eager."""

    LOGGER: ClassVar[str] = FALLBACK_LOGGER
    LEVEL: ClassVar[int] = logging.INFO
    text: str


@dataclass(frozen=True)
class Break:
    """A graph break and where dynamo says it happened."""

    reason: str  # the break's reason, first line
    frames: tuple[Frame, ...]  # the user stack, outermost first
    text: str  # the whole message
    at: Frame | None = None  # dynamo's own "in user code at file:line", when it gave one

    @property
    def in_checkpoint(self) -> bool:
        """Was the break inside a traced checkpoint's body (so that region fell back to eager)?"""
        return HOP_CHECKPOINT_NOTE in self.text


@dataclass(frozen=True)
class FallbackBreak(Break):
    """The break that made a traced checkpoint fall back (the error logged right after ``Fallback``)."""

    LOGGER: ClassVar[str] = FALLBACK_LOGGER
    LEVEL: ClassVar[int] = logging.INFO


@dataclass(frozen=True)
class GraphBreak(Break):
    """One record of dynamo's ``graph_breaks`` log (a repeated break comes without its stack)."""

    LOGGER: ClassVar[str] = GRAPH_BREAK_LOGGER
    LEVEL: ClassVar[int] = logging.DEBUG


@dataclass(frozen=True)
class RecompileLimit:
    """A frame hit dynamo's recompile limit and runs eager from then on."""

    LOGGER: ClassVar[str] = RECOMPILE_LIMIT_LOGGER
    LEVEL: ClassVar[int] = logging.WARNING
    text: str

    @property
    def function(self) -> str:
        """The line naming the function (``function: 'name' (file:line)``), else the whole message."""
        lines = self.text.splitlines()
        return lines[1].strip() if len(lines) > 1 else self.text

    @property
    def code_name(self) -> str | None:
        """The name of the code that hit the limit; None where the message names none."""
        found = _LIMIT_FUNCTION.search(self.text)
        return found.group(1) if found else None

    def in_function(self, name: str) -> bool:
        """Did the code named ``name`` hit the limit, or a resume function dynamo made of it at a break?"""
        code = self.code_name
        # Every level: each strips a prefix, so a name of n characters has fewer than n.
        return code is not None and dynamo.resumed_name(code, levels=len(code)) == name

    @property
    def summary(self) -> str:
        """The limit, the function and the last reason, on one line."""
        return " ".join(line.strip() for line in self.text.splitlines()[:3])


@dataclass(frozen=True)
class WontConvert:
    """dynamo failed to convert a frame and, its errors suppressed, runs it eager ("WON'T CONVERT")."""

    LOGGER: ClassVar[str] = CONVERT_FRAME_LOGGER
    LEVEL: ClassVar[int] = logging.WARNING
    error: BaseException
    thread: int | None  # the thread that logged it (None: ``logging.logThreads`` is off)


Message = Fallback | FallbackBreak | GraphBreak | RecompileLimit | WontConvert


def read(record: logging.LogRecord) -> Message | None:
    """The message ``record`` carries, if it is one autoweave reacts to."""
    if record.name == FALLBACK_LOGGER:
        return _read_fallback(record)
    if record.name == GRAPH_BREAK_LOGGER:
        return _read_graph_break(record.getMessage())
    if record.name == CONVERT_FRAME_LOGGER:
        return _read_convert_frame(record)
    return None


def _read_fallback(record: logging.LogRecord) -> Fallback | FallbackBreak | None:
    error = record.msg
    stack = getattr(error, "real_stack", None)
    if isinstance(error, BaseException):
        if not stack:
            return None
        text = str(error)
        reason = (text.strip().splitlines() or [type(error).__name__])[0]
        return FallbackBreak(reason, tuple(_frame_of(f) for f in stack), text)
    message = record.getMessage()
    return Fallback(message) if FALLBACK_NEEDLE in message else None


def _frame_of(summary: Any) -> Frame:
    # A traceback.FrameSummary (dynamo's ``real_stack``).
    return Frame(str(getattr(summary, "filename", "")), int(getattr(summary, "lineno", 0) or 0), summary.name)


def _read_graph_break(text: str) -> GraphBreak:
    frames = tuple(Frame(f, int(n), name) for f, n, name in _FRAME.findall(text))
    at = _AT.search(text)
    reason = _REASON.search(text)
    return GraphBreak(
        reason.group(1).strip() if reason else "",
        frames,
        text,
        Frame(at.group(1), int(at.group(2)), "") if at else None,
    )


def _read_convert_frame(record: logging.LogRecord) -> RecompileLimit | WontConvert | None:
    # A soft failure (logged at INFO) is dynamo's own choice to skip a frame, not an error.
    error = record.exc_info[1] if record.exc_info else None
    if record.levelno == logging.WARNING and error is not None and SUPPRESSED_NEEDLE in str(record.msg):
        return WontConvert(error, record.thread)
    message = record.getMessage()
    return RecompileLimit(message) if RECOMPILE_LIMIT_NEEDLE in message else None
