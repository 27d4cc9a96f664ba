"""Where in the user's source a boundary, a graph break or an AC fallback is: ``file:line``, as dynamo names it.

Two cheap sources. A boundary's place is read from code objects (the line of
the parent's forward that calls it, and the line where its class's forward is
defined). A graph break's place comes from dynamo's own ``graph_breaks`` log
record, which carries the user stack: ``watch_graph_breaks`` listens to it
without printing anything torch would not have printed.
"""

from __future__ import annotations

import dis
import functools
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from autoweave._compat import GRAPH_BREAK_LOGGER, HOP_CHECKPOINT_NOTE  # dynamo's log signals

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_AT = re.compile(r"in user code at (.+?):(\d+)")
_REASON = re.compile(r"Graph Break Reason: (.*)")


@dataclass(frozen=True)
class Source:
    """A boundary's place: the call in its parent's forward, and its own forward's definition."""

    call: str | None  # "file:line" of ``self.<name>(...)`` in the parent's forward
    forward: str | None  # "file:line" of ``def forward`` of the boundary's class

    def __str__(self) -> str:
        parts = []
        if self.call:
            parts.append(f"called at {self.call}")
        if self.forward:
            parts.append(f"forward at {self.forward}")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, str | None]:
        return {"call": self.call, "forward": self.forward}


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    # Frames in torch or autoweave are not where the user wrote anything.
    import torch

    package = os.path.dirname(os.path.abspath(__file__))  # autoweave's own directory
    return tuple(d + os.sep for d in (os.path.dirname(os.path.abspath(torch.__file__)), package))


def is_user_file(filename: str) -> bool:
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_library_dirs())


def _code_of(fn: Any) -> Any:
    fn = getattr(fn, "__func__", fn)
    for _ in range(8):  # functools.wraps chains (torch.compiler.disable, user decorators)
        if not hasattr(fn, "__wrapped__"):
            break
        fn = fn.__wrapped__
    return getattr(fn, "__code__", None)


def _user_module(module: Any) -> Any:
    # Look through torch's wrappers (checkpoint, FSDP1, compile) to the user's module.
    for _ in range(8):
        modules = getattr(module, "_modules", {})
        inner = next(
            (
                modules[a]
                for a in ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")
                if a in modules
            ),
            None,
        )
        if inner is None:
            return module
        module = inner
    return module


@functools.lru_cache(maxsize=256)
def _attribute_lines(code: Any) -> dict[str, int]:
    """First line on which ``code`` loads each attribute name (``self.experts`` -> 'experts')."""
    lines: dict[str, int] = {}
    line = code.co_firstlineno
    for instruction in dis.get_instructions(code):
        positions = getattr(instruction, "positions", None)  # 3.11+
        if positions is not None and positions.lineno is not None:
            line = positions.lineno
        elif instruction.starts_line:
            line = instruction.starts_line
        if instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(instruction.argval, str):
            lines.setdefault(instruction.argval, line)
    return lines


def forward_site(module: Any) -> str | None:
    """``file:line`` of the forward the user wrote for ``module`` (instance or class)."""
    module = _user_module(module)
    forward = module.__dict__.get("forward") or type(module).forward
    code = _code_of(forward)
    if code is None or not is_user_file(code.co_filename):
        return None
    return f"{code.co_filename}:{code.co_firstlineno}"


def call_site(parent: Any, name: str) -> str | None:
    """``file:line`` of the first ``self.<name>`` in ``parent``'s forward, when the user wrote it.

    A subclass's forward that calls ``super().forward`` leaves the call in a base
    class's forward: the classes are searched in method resolution order.
    """
    parent = _user_module(parent)
    forwards = [parent.__dict__.get("forward")] + [
        cls.__dict__.get("forward") for cls in type(parent).__mro__
    ]
    for forward in forwards:
        code = _code_of(forward) if forward is not None else None
        if code is None or not is_user_file(code.co_filename):
            continue
        line = _attribute_lines(code).get(name)
        if line is not None:
            return f"{code.co_filename}:{line}"
    return None


def source_dict(plan: Any, path: str) -> dict[str, str | None] | None:
    """``plan.source(path)`` as JSON (``{"call": ..., "forward": ...}``), or None."""
    source = plan.source(path) if hasattr(plan, "source") else None
    return source.as_dict() if source is not None else None


def _user_parent(root: Any, path: str) -> tuple[Any, str] | None:
    # The nearest ancestor that is not a torch wrapper, and the attribute it calls.
    parts = path.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        name = parts[cut]
        if name in ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"):
            continue
        parent = root.get_submodule(".".join(parts[:cut])) if cut else root
        return parent, name
    return None


def boundary_source(root: Any, path: str) -> Source | None:
    """Where the boundary at ``path`` under ``root`` is called and defined; None if neither is user code."""
    try:
        module = root.get_submodule(path)
        found = _user_parent(root, path)
        call = call_site(*found) if found is not None else None
        source = Source(call, forward_site(module))
    except Exception:  # a best-effort annotation never fails planning
        return None
    return source if source.call or source.forward else None


# -- graph breaks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BreakSite:
    site: str  # "file:line" of the user's code
    reason: str  # the break's reason, first line
    text: str  # the whole record (reason and user stack)


def site_of_record(text: str) -> str | None:
    """The user's line in one graph-break record: the innermost user frame of its stack, else dynamo's."""
    user = [f"{f}:{n}" for f, n, _ in _FRAME.findall(text) if is_user_file(f)]
    if user:
        return user[-1]
    at = _AT.search(text)
    if at and is_user_file(at.group(1)):
        return f"{at.group(1)}:{at.group(2)}"
    return None


class _GraphBreakWatch(logging.Handler):
    """Listens to dynamo's graph-break records; passes on what torch would have shown anyway."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.sites: list[BreakSite] = []
        self._lock_sites = threading.Lock()
        self._logger = logging.getLogger(GRAPH_BREAK_LOGGER)
        self._shown_from: int | None = None  # level torch's handlers saw before we listened

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            site = site_of_record(text)
            if site is not None:
                reason = _REASON.search(text)
                with self._lock_sites:
                    self.sites.append(BreakSite(site, reason.group(1).strip() if reason else "", text))
        except Exception:
            pass
        if self._shown_from is not None and record.levelno >= self._shown_from:
            parent = self._logger.parent
            if parent is not None:
                parent.handle(record)

    def install(self) -> None:
        log = self._logger
        self._saved = (log.level, log.propagate)
        log.addHandler(self)
        if log.getEffectiveLevel() > logging.DEBUG:
            # Listen at DEBUG without showing DEBUG: stop propagation, pass on the rest.
            self._shown_from = log.getEffectiveLevel() if log.propagate else logging.CRITICAL + 1
            log.setLevel(logging.DEBUG)
            log.propagate = False

    def uninstall(self) -> None:
        log = self._logger
        log.removeHandler(self)
        if not any(isinstance(h, _GraphBreakWatch) for h in log.handlers):
            log.setLevel(self._saved[0])
            log.propagate = self._saved[1]


_watch: _GraphBreakWatch | None = None
_watch_lock = threading.Lock()


class recording_graph_breaks:  # noqa: N801 - used like a function: `with recording_graph_breaks() as sites:`
    """The graph breaks dynamo logs while the block runs (``BreakSite``s, in order)."""

    def __enter__(self) -> list[BreakSite]:
        self._watch = _GraphBreakWatch()
        self._watch.install()
        return self._watch.sites

    def __exit__(self, *exc: Any) -> None:
        self._watch.uninstall()


def watch_graph_breaks() -> None:
    """Start recording where graph breaks happen, from now on (the report turns it on)."""
    global _watch
    with _watch_lock:
        if _watch is None:
            _watch = _GraphBreakWatch()
            _watch.install()
        else:
            # A new report starts: it owns the sites seen from here, not an earlier report's.
            with _watch._lock_sites:
                _watch.sites.clear()


def _sites() -> list[BreakSite]:
    if _watch is None:
        return []
    with _watch._lock_sites:
        return list(_watch.sites)


def graph_break_sites(reasons: Any = ()) -> dict[str, list[str]]:
    """For each reason dynamo counted (``counters["graph_break"]`` keys), the user lines it broke at.

    A record belongs to a reason when the record's text contains the reason's
    first line (dynamo counts ``exc.msg`` and logs ``prefix + str(exc)``). dynamo
    logs a repeated break (same kind, same place) without its stack, so these are
    places, not counts.
    """
    sites = _sites()
    out: dict[str, list[str]] = {}
    for reason in reasons:
        first = reason.strip().splitlines()[0] if reason.strip() else ""
        found = sorted({s.site for s in sites if first and first in s.text})
        if found:
            out[reason] = found
    return out


def fallback_sites() -> list[str]:
    """The user lines of breaks inside a traced checkpoint: where checkpointed regions fell back to eager."""
    return sorted({s.site for s in _sites() if HOP_CHECKPOINT_NOTE in s.text})


def first_site(sites: dict[str, list[str]], first_line: str) -> str:
    """`` at file:line`` for the exit summary's break line (its reason cut to the first line), or ""."""
    for reason, found in sites.items():
        if found and reason.strip().splitlines()[0][:100] == first_line:
            return f" at {found[0]}" + (f" (+{len(found) - 1} more)" if len(found) > 1 else "")
    return ""
