"""Where dynamo broke a checkpointed region: its user stack, mapped to the modules that hold it.

When dynamo cannot trace a checkpoint as one graph it logs (INFO) that it
falls back to eager, then logs the ``Unsupported`` error itself, with the user's
frames from the compiled frame down to the break (read by
``observe.counting.FallbackCounter`` as ``FallbackBreak``s). The innermost frame
that runs a module's forward names the module that breaks (``locate``): the planner
then treats it as a boundary and compiles around it. What one block taught is kept
by forward code (``planning/learned``).
"""

from __future__ import annotations

import os
from typing import Any

import torch.nn as nn

from autoweave._compat.log_strings import Break
from autoweave.planning import boundaries, sources


def _span(code: Any) -> tuple[str, int, int] | None:
    lines = [line for _, _, line in code.co_lines() if line is not None] if hasattr(code, "co_lines") else []
    if not lines:
        return None
    return os.path.abspath(code.co_filename), min(lines), max(lines)


def _forward_span(module: nn.Module) -> tuple[str, int, int] | None:
    code = forward_code(module)
    return _span(code) if code is not None else None


def locate(target: nn.Module, breaks: list[Break]) -> dict[int, str]:
    """Modules of ``target`` (by id) whose own forward holds a break, with a reason naming file:line.

    For each break, the innermost of its user frames (``sources.break_frames``)
    inside a module's forward wins. Several instances of one class all match
    (they run the same code).
    """
    import torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    spans: list[tuple[tuple[str, int, int], nn.Module]] = []
    for _, module in target.named_modules():
        span = _forward_span(module)
        if span is not None and not span[0].startswith(torch_dir):  # wrappers' forwards are torch's
            spans.append((span, module))
    found: dict[int, str] = {}
    for brk in breaks:
        for frame in sources.break_frames(brk):
            filename = os.path.abspath(frame.filename)
            hits = [m for (f, first, last), m in spans if f == filename and first <= frame.lineno <= last]
            if not hits:
                continue
            where = f"{os.path.basename(filename)}:{frame.lineno}"
            for module in hits:
                found.setdefault(id(module), f"graph break in its forward at {where} ({brk.reason})")
            break
    return found


def forward_code(module: nn.Module) -> Any:
    """The code object of ``module``'s user forward (what identical blocks share), or None."""
    forward = boundaries.user_forward(module)
    return getattr(getattr(forward, "__func__", forward), "__code__", None)
