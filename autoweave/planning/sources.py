"""Where in the user's source a boundary is: ``file:line``, read from code objects.

A boundary's place is the line of the parent's forward that calls it, and the
line where its class's forward is defined; both are cheap to read and never
fail planning (a best-effort annotation for messages).
"""

from __future__ import annotations

import dis
import functools
import os
import types
from dataclasses import dataclass
from typing import Any

from autoweave import _compat
from autoweave._compat.log_strings import Break, Frame


@dataclass(frozen=True)
class Source:
    """A boundary's place: the call in its parent's forward, and its own forward's definition."""

    call: str | None  # "file:line" of ``self.<name>(...)`` in the parent's forward
    forward: str | None  # "file:line" of ``def forward`` of the boundary's class

    def __str__(self) -> str:
        parts = (("called at", self.call), ("forward at", self.forward))
        return ", ".join(f"{label} {where}" for label, where in parts if where)

    def as_dict(self) -> dict[str, str | None]:
        return {"call": self.call, "forward": self.forward}


@functools.cache
def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__))


def torch_file(filename: str) -> bool:
    """Is ``filename`` under torch's install directory (a bare prefix: ``torchvision/`` counts too)?"""
    return os.path.abspath(filename).startswith(_torch_dir())


def cell_value(cell: types.CellType, empty: Any = None) -> Any:
    """What a closure cell holds, or ``empty`` for a cell not filled yet (reading never raises)."""
    try:
        return cell.cell_contents
    except ValueError:
        return empty


def user_function(fn: Any) -> bool:
    """Does ``fn`` have code of its own outside torch's files (a copy keeps its file name)?"""
    code = getattr(fn, "__code__", None)
    return isinstance(code, types.CodeType) and not torch_file(code.co_filename)


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    # Frames in torch or autoweave are not where the user wrote anything.
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the autoweave package, not plan/
    return (_torch_dir() + os.sep, package + os.sep)


def is_user_file(filename: str) -> bool:
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_library_dirs())


def break_frames(found: Break) -> list[Frame]:
    """Where a graph break is in the user's source: the frames of its stack in user files, innermost first.

    The one reading of a break's place: the report names the first of these
    (``sense.graph_breaks``), the planner the first that lies in a module's
    forward (``learned.locate``). A break logged without a stack in user
    code (dynamo logs a repeated one so) falls back to dynamo's own
    "in user code at" line, when that is the user's.
    """
    frames = [frame for frame in reversed(found.frames) if is_user_file(frame.filename)]
    if not frames and found.at is not None and is_user_file(found.at.filename):
        frames.append(found.at)
    return frames


def _user_code(fn: Any) -> Any:
    """The code of ``fn`` under its decorators, when it lies in a user file; else None."""
    fn = getattr(fn, "__func__", fn)
    for _ in range(8):  # functools.wraps chains (torch.compiler.disable, user decorators)
        if not hasattr(fn, "__wrapped__"):
            break
        fn = fn.__wrapped__
    code = getattr(fn, "__code__", None)
    return code if code is not None and is_user_file(code.co_filename) else None


def _user_module(module: Any) -> Any:
    # Look through torch's wrappers (checkpoint, FSDP1, compile) to the user's module.
    for _ in range(8):
        inner = _compat.modules.wrapped_child(module)
        if inner is None:
            return module
        module = inner
    return module


@functools.lru_cache(maxsize=256)
def attribute_lines(code: Any) -> dict[str, int]:
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
    code = _user_code(module.__dict__.get("forward") or type(module).forward)
    return None if code is None else f"{code.co_filename}:{code.co_firstlineno}"


def call_site(parent: Any, name: str) -> str | None:
    """``file:line`` of the first ``self.<name>`` in ``parent``'s forward, when the user wrote it.

    A subclass's forward that calls ``super().forward`` leaves the call in a base
    class's forward: the classes are searched in method resolution order.
    """
    parent = _user_module(parent)
    for owner in (parent, *type(parent).__mro__):
        code = _user_code(owner.__dict__.get("forward"))
        line = None if code is None else attribute_lines(code).get(name)
        if line is not None:
            return f"{code.co_filename}:{line}"
    return None


def source_dict(plan: Any, path: str) -> dict[str, str | None] | None:
    """``plan.source(path)`` as JSON (``{"call": ..., "forward": ...}``), or None."""
    source = plan.source(path) if hasattr(plan, "source") else None
    return source.as_dict() if source is not None else None


def boundary_source(root: Any, path: str) -> Source | None:
    """Where the boundary at ``path`` under ``root`` is called and defined; None if neither is user code."""
    try:
        module = root.get_submodule(path)
        # The call is in the nearest ancestor that is not a torch wrapper, to the attribute below it.
        parts = path.split(".")
        user = [i for i, name in enumerate(parts) if name not in _compat.modules.WRAPPED_CHILD_ATTRS]
        call = call_site(root.get_submodule(".".join(parts[: user[-1]])), parts[user[-1]]) if user else None
        source = Source(call, forward_site(module))
    except Exception:  # a best-effort annotation never fails planning
        return None
    return source if source.call or source.forward else None
