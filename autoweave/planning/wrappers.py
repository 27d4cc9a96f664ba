"""Whether a decorator's wrapper merely passes its call on: read from its source, never run.

A split region compiles a decorated ``forward`` from the function the decorators
wrap, with each wrapper running as in eager (``weave.apply``): compiled, every
wrapper would be a frame of its own, traced to the break and again. That is
right only for a wrapper that computes nothing: one whose ops on tensors ran
eager would leave them out of the compiled graphs and, under ``pieces``, out of
any checkpoint (their activations kept, where plain torch's checkpoint recomputes
them). So a wrapper runs eager only when this rule proves it passes the call on;
anything else is compiled as a frame of its own.

The rule is conservative and static. Tensors reach a wrapper only through its
parameters and the wrapped call's result. It may read them: test them (``if``,
``and``, ``not``, ``is``, ``in``), format them into a message, read attributes
(``self.training``), items of its ``*args``/``**kwargs`` and rename, pop or set
keyword arguments; it may call anything on values that are not theirs
(``warnings.warn(message)``), and hand the wrapped function on (``functools.partial``,
a checkpoint function given it). It must return what the wrapped call returned,
unchanged. Arithmetic, indexing, methods or calls on a parameter (``x * 2``,
``x[0]``, ``x.float()``, ``torch.relu(x)``, ``self.norm(x)``) or on the result,
and code this rule does not read (a comprehension, a nested function, source it
cannot find) mean: not a pass-through.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import functools
import inspect
import textwrap
import types
from collections.abc import Callable
from typing import Any

from autoweave.planning import sources


class _Kind(enum.Enum):
    CLEAN = "no tensor of the call's"  # constants, globals, messages, types
    VALUE = "may be a tensor of the call's"  # a parameter, an item or attribute of one
    PACK = "the *args tuple or the **kwargs dict"  # items may be tensors; the pack itself is not
    CALL = "the wrapped function"  # or a partial of it
    RESULT = "what the wrapped call returned"


class _Computes(Exception):
    """What the wrapper does is more than passing the call on (or more than this rule reads)."""


# Builtins that look at a value without computing on it.
_INSPECTING = frozenset({"type", "isinstance", "issubclass", "len", "id", "callable", "hasattr"})
_PACK_METHODS = frozenset({"get", "pop", "setdefault", "update", "keys", "values", "items", "copy", "index"})
_ANY = frozenset(_Kind)
_NOT_CALLS = frozenset({_Kind.CLEAN, _Kind.VALUE, _Kind.PACK})  # what a test or a display may hold


def passes_call_on(wrapper: Callable[..., Any]) -> bool:
    """True when ``wrapper`` (a ``functools.wraps`` wrapper) provably only passes its call on."""
    wrapped = getattr(wrapper, "__wrapped__", None)
    code = getattr(wrapper, "__code__", None)
    if code is None or wrapped is None:
        return False
    cells = zip(code.co_freevars, wrapper.__closure__ or (), strict=False)
    names = [name for name, cell in cells if sources.cell_value(cell) is wrapped]
    if len(names) != 1 or (node := _source_tree(code)) is None:
        return False
    reader = _Reader(node, names[0], wrapper.__globals__)
    with contextlib.suppress(_Computes):  # it does more than pass the call on
        # Flow-insensitive: bindings only widen a name's kind, so a few passes reach the fixpoint.
        for _ in range(8):
            before = dict(reader.names)
            reader.block(node.body)
            if reader.names == before:
                return True
    return False


@functools.lru_cache(maxsize=256)
def _source_tree(code: types.CodeType) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError):  # no source (exec, a frozen module), or not one def
        return None
    return tree.body[0] if tree.body and isinstance(tree.body[0], ast.FunctionDef) else None


class _Reader:
    def __init__(self, node: ast.FunctionDef, wrapped: str, globals_: dict[str, Any]) -> None:
        self.wrapped = wrapped
        self.globals = globals_
        a = node.args
        self.names: dict[str, _Kind] = {p.arg: _Kind.VALUE for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
        self.names.update({pack.arg: _Kind.PACK for pack in (a.vararg, a.kwarg) if pack is not None})

    # -- statements --------------------------------------------------------------------------
    def block(self, body: list[ast.stmt]) -> None:
        for statement in body:
            self.statement(statement)

    def statement(self, s: ast.stmt) -> None:
        if isinstance(s, ast.Return):
            if s.value is None or self.kind(s.value) is not _Kind.RESULT:
                raise _Computes("returns something other than the wrapped call's result")
        elif isinstance(s, ast.Assign):
            value = self.kind(s.value)
            for target in s.targets:
                self.bind(target, value)
        elif isinstance(s, ast.AnnAssign):
            if s.value is not None:
                self.bind(s.target, self.kind(s.value))
        elif isinstance(s, ast.AugAssign):
            # ``message += "..."``: only on values that are not the call's
            self.clean(s.target, s.value)
            self.bind(s.target, _Kind.CLEAN)
        elif isinstance(s, (ast.Expr, ast.Raise, ast.Assert)):
            for part in ast.iter_child_nodes(
                s
            ):  # the value; what is raised and its cause; the test, a message
                self.kind(part)
        elif isinstance(s, (ast.If, ast.While)):
            self.kind(s.test)
            self.block(s.body)
            self.block(s.orelse)
        elif isinstance(s, ast.For):
            over = self.kind(s.iter)
            if over not in (_Kind.PACK, _Kind.CLEAN):
                raise _Computes("iterates over a tensor")
            self.bind(s.target, _Kind.VALUE if over is _Kind.PACK else _Kind.CLEAN)
            self.block(s.body)
            self.block(s.orelse)
        elif isinstance(s, ast.With):
            for item in s.items:
                self.clean(item.context_expr)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, _Kind.CLEAN)
            self.block(s.body)
        elif isinstance(s, ast.Try):
            self.block(s.body)
            for handler in s.handlers:
                if handler.type is not None:
                    self.kind(handler.type)
                if handler.name:
                    self.names[handler.name] = _Kind.CLEAN
                self.block(handler.body)
            self.block(s.orelse)
            self.block(s.finalbody)
        elif isinstance(s, ast.Delete):
            for target in s.targets:
                self.bind(target, _Kind.CLEAN)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            for alias in s.names:
                self.names[(alias.asname or alias.name).split(".")[0]] = _Kind.CLEAN
        elif not isinstance(s, (ast.Pass, ast.Break, ast.Continue)):
            raise _Computes(type(s).__name__)  # nested defs, global/nonlocal, match, async

    def bind(self, target: ast.expr, kind: _Kind) -> None:
        if isinstance(target, ast.Name):
            held = self.names.get(target.id)
            # Bound to two kinds (the result on one path, something else on another): a value
            # that may be a tensor and is not plainly the result.
            self.names[target.id] = kind if held is None or held is kind else _Kind.VALUE
        elif isinstance(target, ast.Subscript) and self.kind(target.value) is _Kind.PACK:
            self.kind(target.slice)  # ``kwargs[new] = kwargs.pop(old)``: renaming an argument
        elif isinstance(target, (ast.Tuple, ast.List)) and kind in (_Kind.CLEAN, _Kind.VALUE, _Kind.PACK):
            for element in target.elts:
                inner = element.value if isinstance(element, ast.Starred) else element
                self.bind(inner, _Kind.CLEAN if kind is _Kind.CLEAN else _Kind.VALUE)
        else:
            raise _Computes("sets an attribute or item of the call's values")

    # -- expressions -------------------------------------------------------------------------
    def clean(self, *nodes: ast.expr) -> None:
        for node in nodes:
            if self.kind(node) is not _Kind.CLEAN:
                raise _Computes("computes on the call's values")

    def kind(self, node: ast.expr) -> _Kind:
        if isinstance(node, ast.Constant):
            return _Kind.CLEAN
        if isinstance(node, ast.Name):
            if node.id in self.names:
                return self.names[node.id]
            return _Kind.CALL if node.id == self.wrapped else _Kind.CLEAN
        if isinstance(node, ast.JoinedStr):  # a message: formatting reads values, keeps nothing
            for part in node.values:
                if isinstance(part, ast.FormattedValue):
                    self.kind(part.value)
            return _Kind.CLEAN
        if isinstance(node, ast.Attribute):
            base = self.kind(node.value)
            if base in (_Kind.CLEAN, _Kind.CALL) or (node.attr.startswith("__") and base is not _Kind.RESULT):
                return _Kind.CLEAN  # ``func.__name__``, ``self.__class__.__name__``
            if base in (_Kind.VALUE, _Kind.PACK):
                return _Kind.VALUE  # ``self.training``: a read, no op
            raise _Computes("reads into the wrapped call's result")
        if isinstance(node, ast.Subscript):
            base = self.kind(node.value)
            self.kind(node.slice)
            if base is _Kind.PACK:
                return _Kind.VALUE  # ``args[0]``, ``kwargs["use_cache"]``
            if base is _Kind.CLEAN:
                return _Kind.CLEAN
            raise _Computes("indexes a tensor")
        if isinstance(node, ast.Slice):
            self.clean(*(part for part in (node.lower, node.upper, node.step) if part is not None))
            return _Kind.CLEAN
        if isinstance(node, ast.BoolOp):  # a test: truthiness only
            return self.widest([self.kind(value) for value in node.values], allowed=_NOT_CALLS)
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.Not):
                self.kind(node.operand)
            else:
                self.clean(node.operand)
            return _Kind.CLEAN
        if isinstance(node, ast.BinOp):
            self.clean(node.left, node.right)
            return _Kind.CLEAN
        if isinstance(node, ast.Compare):
            return self.compare(node)
        if isinstance(node, ast.IfExp):
            self.kind(node.test)
            return self.widest([self.kind(node.body), self.kind(node.orelse)], allowed=_ANY)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            kinds = [self.kind(e.value if isinstance(e, ast.Starred) else e) for e in node.elts]
            return self.packed(kinds)
        if isinstance(node, ast.Dict):
            return self.packed([self.kind(part) for part in (*node.keys, *node.values) if part is not None])
        if isinstance(node, ast.Call):
            return self.call(node)
        raise _Computes(type(node).__name__)  # lambdas, comprehensions, walrus, await, yield

    def widest(self, kinds: list[_Kind], allowed: frozenset[_Kind]) -> _Kind:
        if not set(kinds) <= allowed:
            raise _Computes("combines the wrapped call's result with other values")
        if len(set(kinds)) == 1:
            return kinds[0]
        return _Kind.CLEAN if set(kinds) <= {_Kind.CLEAN} else _Kind.VALUE

    def packed(self, kinds: list[_Kind]) -> _Kind:
        """A tuple, list, set or dict built of ``kinds``: may hold the call's values, is none of them."""
        return _Kind.CLEAN if self.widest(kinds, allowed=_NOT_CALLS) is _Kind.CLEAN else _Kind.VALUE

    def compare(self, node: ast.Compare) -> _Kind:
        operands = [self.kind(node.left), *(self.kind(c) for c in node.comparators)]
        for op, right in zip(node.ops, operands[1:], strict=True):
            if isinstance(op, (ast.Is, ast.IsNot)):
                continue  # identity: no op on a tensor
            if isinstance(op, (ast.In, ast.NotIn)) and right in (_Kind.PACK, _Kind.CLEAN):
                continue  # ``"use_cache" in kwargs``
            if any(kind is not _Kind.CLEAN for kind in operands):
                raise _Computes("compares a tensor")  # ``x > 0`` is an op
        return _Kind.CLEAN

    def call(self, node: ast.Call) -> _Kind:
        args = [self.kind(a.value if isinstance(a, ast.Starred) else a) for a in node.args]
        args += [self.kind(k.value) for k in node.keywords]
        func = node.func
        if isinstance(func, ast.Name) and func.id == self.wrapped and func.id not in self.names:
            return _Kind.RESULT
        if _Kind.CALL in args:
            # The wrapped function handed on: to ``functools.partial``, or to what makes the call
            # (transformers' ``self._gradient_checkpointing_func(partial(forward, ...), *args)``).
            return _Kind.CALL if self.resolves_to(func, functools.partial) else _Kind.RESULT
        if (
            isinstance(func, ast.Attribute)
            and func.attr in _PACK_METHODS
            and self.kind(func.value) is _Kind.PACK
        ):
            return _Kind.VALUE  # ``kwargs.pop("old")``
        if isinstance(func, ast.Name) and func.id in _INSPECTING and func.id not in self.names:
            return _Kind.CLEAN  # ``type(self)``, ``isinstance(x, ...)``
        self.clean(func)
        if any(kind is not _Kind.CLEAN for kind in args):
            raise _Computes("calls something other than the wrapped function on the call's values")
        return _Kind.CLEAN

    def resolves_to(self, func: ast.expr, obj: Any) -> bool:
        """Does ``func`` name ``obj`` through the wrapper's globals (``partial``, ``functools.partial``)?"""
        if isinstance(func, ast.Name) and func.id not in self.names:
            return self.globals.get(func.id) is obj
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id not in self.names
        ):
            return getattr(self.globals.get(func.value.id), func.attr, None) is obj
        return False
