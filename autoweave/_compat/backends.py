"""The backend ``torch.compile`` builds, wrapped unchanged, what dynamo guards compiled code on,
and each graph dynamo hands a backend.

The backend: what ``torch.compile`` builds from its arguments, wrapped without
changing what compiles; the backends torch's own wrappers hold; the backend object of
one compile (``compile_wrapper_of``); dynamo's hand-off of a graph (``listen_to_graphs``).

Torch range: ``torch._TorchCompileInductorWrapper`` / ``torch._TorchCompileWrapper``
and ``torch._dynamo.backends.registry.lookup_backend`` on 2.11-2.15 (the inductor
wrapper takes a ``name`` on newer releases, and a backend's ``_dynamo_backend_init`` hook is
2.15+). torch.compile has no public "build the backend for these arguments";
no upstream issue asks for one that we found. Why a wrapper must compare as the
backend it wraps: dynamo reuses a frame's graphs only for an equal backend, and
recompiles everything for a backend built anew (pytorch#168373, open).

The guards: a shared region splits only where dynamo really specializes on
something that differs between the blocks sharing it (``weave/shared_kinds``).
The evidence is dynamo's own: the guard text (torch 2.4+) of the cache entries
it made for the region's code and for the resume functions it made at each graph
break. Nothing here changes a cache; reading one costs a walk of a few entries,
done only after a compile.

TODO: ``_debug_get_cache_entry_list`` and ``GuardManagerWrapper.code_parts``
(checked on torch 2.13) are debugging surfaces with no stability promise; a
public "guards of this code" query would retire the guard reading here
(pytorch#114082 asked for one and was closed by pointing at this same debug
API). Where they are missing nothing is read and nothing splits.
"""

from __future__ import annotations

import functools
import inspect
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from autoweave import _installs
from autoweave._compat.lookup import UnsupportedTorch, find, find_optional, need

_LOOKUP_BACKEND = need("torch._dynamo.backends.registry.lookup_backend")
_INDUCTOR_WRAPPER = need("torch._TorchCompileInductorWrapper")
_COMPILE_WRAPPER = need("torch._TorchCompileWrapper")


def lookup_backend(backend: Any) -> Any:
    """A backend by name, as torch.compile resolves it (``aot_eager`` -> its callable)."""
    return find(_LOOKUP_BACKEND)(backend)


def compile_backend(
    backend: Any, mode: str | None, options: dict | None, dynamic: Any, name: str | None
) -> Any:
    """The backend callable ``torch.compile(..., backend=, mode=, options=)`` would build.

    Lets a woven region hold it in its own backend and hand ``torch.compile`` that
    backend with ``mode``/``options`` removed, compiling exactly the same way.
    """
    if mode is None and options is None:
        mode = "default"
    if backend is None or backend == "inductor":
        wrapper = find(_INDUCTOR_WRAPPER)
        try:
            return wrapper(mode, options, dynamic, name)
        except TypeError:  # torch before the `name` argument
            return wrapper(mode, options, dynamic)
    return find(_COMPILE_WRAPPER)(backend, mode, options, dynamic)


# What each autotuning mode is without its autotuning: its other options kept (CUDA graphs).
_UNTUNED_MODES = {"max-autotune": "reduce-overhead", "max-autotune-no-cudagraphs": "default"}
_AUTOTUNE_OPTIONS = ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise")


def untuned_backend(kwargs: dict[str, Any]) -> Any:
    """What ``torch.compile(**kwargs)`` would build without inductor's autotuning; None if none is asked.

    Autotuning compiles kernels and templates the default mode never builds, and may
    raise where the default mode compiles (an MoE's experts on an H200 under
    ``max-autotune-no-cudagraphs``, issue 41): a region's graph is then compiled untuned.
    """
    backend, mode, options = kwargs.get("backend", "inductor"), kwargs.get("mode"), kwargs.get("options")
    if backend not in (None, "inductor"):
        return None
    if mode in _UNTUNED_MODES:
        return compile_backend(backend, _UNTUNED_MODES[mode], None, kwargs.get("dynamic"), kwargs.get("name"))
    if not isinstance(options, dict) or not any(options.get(k) for k in _AUTOTUNE_OPTIONS):
        return None
    kept = {k: v for k, v in options.items() if k not in (*_AUTOTUNE_OPTIONS, "guard_filter_fn")}
    return compile_backend(backend, None, kept or None, kwargs.get("dynamic"), kwargs.get("name"))


class ForwardsToInner:
    """What a backend wrapping ``inner`` must hand on so dynamo treats ``inner`` as it would alone.

    ``__name__`` (torch.compile names its wrapper after it, ``compiler_name``, and
    dynamo treats a registered name as a built-in backend), ``reset`` (dynamo resets
    every backend it cached at ``torch._dynamo.reset()``) and, from torch 2.15,
    ``_dynamo_backend_init`` (a no-argument set-up hook dynamo reads off the backend
    at ``torch.compile()``; torch's own wrapper forwards it the same way: hidden,
    the wrapped backend would skip its set-up).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.__name__ = str(getattr(inner, "compiler_name", None) or getattr(inner, "__name__", "backend"))

    def reset(self) -> None:
        reset = getattr(self.inner, "reset", None)
        if reset is not None:
            reset()

    @property
    def _dynamo_backend_init(self) -> Any:
        return getattr(self.inner, "_dynamo_backend_init", None)


def wrap_backend(kwargs: dict[str, Any], wrap: Any) -> dict[str, Any]:
    """``torch.compile`` kwargs whose backend is ``wrap(the callable torch would build)``.

    ``backend``, ``mode`` and ``options`` become that one callable (options
    dynamo reads itself, ``guard_filter_fn``, stay), so compiling through the
    wrapper compiles exactly as asked. AOTInductor options are not rebuilt:
    ``UnsupportedTorch``.
    """
    options = kwargs.get("options")
    if isinstance(options, dict) and options.get("use_aoti"):
        raise UnsupportedTorch("AOTInductor compile options cannot be wrapped")
    kept = dict(options) if isinstance(options, dict) else None
    guard_filter_fn = kept.pop("guard_filter_fn", None) if kept else None
    inner = compile_backend(
        kwargs.get("backend", "inductor"), kwargs.get("mode"), kept, kwargs.get("dynamic"), kwargs.get("name")
    )
    out = {k: v for k, v in kwargs.items() if k not in ("backend", "mode", "options")}
    out["backend"] = wrap(inner)
    if guard_filter_fn is not None:
        out["options"] = {"guard_filter_fn": guard_filter_fn}
    return out


# dynamo names the resume functions it makes at a graph break ``__resume_at_<offset>_<n>``
# and stores them in the globals of the function that broke.
RESUME_PREFIX = "__resume_at_"

# ``L['self']._modules['attn'].layer_idx == 3``, ``L['m'].causal is None``: the attribute
# an equality or identity guard reads (the name right before the comparison).
_GUARDED_ATTRIBUTE = re.compile(r"\.([A-Za-z_]\w*)\s*(?:==|!=|is\b)")


# The C name: ``torch._dynamo.eval_frame``'s function of that name only forwards to it.
_CACHE_ENTRY_LIST = need("torch._C._dynamo.eval_frame._debug_get_cache_entry_list", required=False)


@functools.cache
def _cache_entry_list() -> Callable[..., list[Any]] | None:
    # Looked up once: ``regions.lookups_in_order`` asks on every woven call inside an eager checkpoint.
    return find_optional(_CACHE_ENTRY_LIST)


def cache_entries(code: Any) -> list[Any]:
    """The cache entries dynamo holds for ``code`` ([] where it holds none, or they cannot be read)."""
    entries = _cache_entry_list()
    if entries is None:
        return []
    try:
        return list(entries(code))
    except Exception:  # a code object dynamo never saw, or a torch that moved the field
        return []


def _region_frames(fn: Callable[..., Any]) -> Iterator[tuple[Callable[..., Any], list[Any]]]:
    """Each frame of ``fn``'s region with its cache entries: its code, the functions it wraps, its resume functions."""
    seen: set[int] = set()
    todo = [fn]
    while todo:
        current = todo.pop()
        code = getattr(current, "__code__", None)
        if code is None or id(code) in seen:
            continue
        seen.add(id(code))
        # A decorator's copied wrapper breaks at its call of the wrapped copy: a frame of its own.
        todo.append(getattr(current, "__wrapped__", None))
        entries = cache_entries(code)
        yield current, entries
        for entry in entries:
            transformed = getattr(entry, "code", None)
            for name in getattr(transformed, "co_names", ()):
                if name.startswith(RESUME_PREFIX):
                    todo.append(current.__globals__.get(name))


def guard_texts(fn: Callable[..., Any], codes: Iterable[Any] = ()) -> Iterator[str]:
    """The guard text of every cache entry of ``fn``'s code, the functions it wraps, its resume functions and ``codes``."""
    entries = [e for _, found in _region_frames(fn) for e in found]
    entries += [e for code in tuple(codes) for e in cache_entries(code)]
    for entry in entries:
        manager = getattr(entry, "guard_manager", None)
        yield from getattr(manager, "code_parts", None) or ()


def entry_counts(fn: Callable[..., Any]) -> list[tuple[str, int]]:
    """Each frame of ``fn``'s region (as ``guard_texts`` walks them) by name, with its cache entries' count."""
    return [(f.__code__.co_name, len(entries)) for f, entries in _region_frames(fn)]


def guarded_attributes(fn: Callable[..., Any], codes: Iterable[Any] = ()) -> frozenset[str]:
    """Names of attributes whose value ``fn``'s compiled code (and ``codes``') is guarded on (``==``, ``is``)."""
    return frozenset(name for text in guard_texts(fn, codes) for name in _GUARDED_ATTRIBUTE.findall(text))


# Where torch's wrappers of a backend keep the one they wrap: ``WrapBackendDebug`` and
# ``_TorchCompileWrapper`` (``_torchdynamo_orig_backend``, ``compiler_fn``), autoweave's own
# (``inner``), a ``functools.partial`` (``func``).
_WRAPPED_BACKEND = ("_torchdynamo_orig_backend", "compiler_fn", "inner", "func")


def backends_within(backend: Any, depth: int = 8) -> Iterator[Any]:
    """``backend`` and every backend it wraps, outermost first."""
    return _installs.chain(backend, _WRAPPED_BACKEND, depth)


def compile_wrapper_of(compiled: Any) -> Any:
    """The backend object ``torch.compile`` built for ``compiled`` (a module or a function it returned), or None.

    It is what dynamo hands each graph of that compile (through its own wrappers:
    ``backends_within``), and a fresh one at every ``torch.compile``. An
    ``OptimizedModule`` holds its compile context (``dynamo_ctx``); a compiled
    function holds it only in the closure of the ``get_compiler_config`` torch
    sets on it (2.11-2.15).
    """
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is None:
        cells = getattr(getattr(compiled, "get_compiler_config", None), "__closure__", None) or ()
        ctx = next((c.cell_contents for c in cells if hasattr(c.cell_contents, "callback")), None)
    wrappers = tuple(filter(None, map(find_optional, _COMPILE_WRAPPERS)))
    within = backends_within(getattr(ctx, "callback", None))
    return next((b for b in within if isinstance(b, wrappers)), None)  # isinstance(b, ()) is False


_COMPILE_WRAPPERS = (_COMPILE_WRAPPER, _INDUCTOR_WRAPPER)


# Handing a graph to its backend: dynamo's compile callbacks carry a compile id, never the
# graph, and a wrapper around the backend would change the compile it watches (the wrapped
# backend answers ``get_compiler_config`` and ``isinstance`` otherwise). So the one place
# dynamo hands a backend its graph, ``OutputGraph.call_user_compiler(self, gm,
# example_inputs)`` (2.11-2.15; ``self.compiler_fn`` is the backend), is wrapped while
# someone listens. No upstream issue asks for a public graph callback that we found.
HANDOFF_MODULE = need("torch._dynamo.output_graph", required=False)
_HANDOFF = "call_user_compiler"


def _handoff_takes_graph() -> bool:
    code = getattr(inspect.unwrap(getattr(find(_OUTPUT_GRAPH), _HANDOFF, None)), "__code__", None)
    return code is not None and code.co_varnames[:3] == ("self", "gm", "example_inputs")


_OUTPUT_GRAPH = need(
    f"{HANDOFF_MODULE}.OutputGraph",
    what="torch._dynamo.output_graph.OutputGraph.call_user_compiler(self, gm, example_inputs)",
    probe=_handoff_takes_graph,
)


def listen_to_graphs(listener: Callable[[Any, Any], Any]) -> Callable[[], None]:
    """``listener(backend, gm)`` as dynamo hands ``backend`` a graph ``gm``; returns the undo.

    What the listener returns, if not None, is called with the backend's result and
    the seconds it took. Neither may raise: they run inside the user's compile.
    dynamo's hand-off is wrapped once its module is imported (importing it here
    would import dynamo); the undo unwraps it, or, where someone wrapped it since,
    leaves it calling straight through.
    """
    undos: list[Callable[[], None]] = []

    def wrap(module: Any) -> None:
        owner = module.OutputGraph
        if vars(owner).get(_HANDOFF) is None or undos:
            return

        def make(original: Any, on: Callable[[], bool]) -> Any:
            @functools.wraps(original)
            def call_user_compiler(self: Any, gm: Any, example_inputs: Any) -> Any:
                after = listener(self.compiler_fn, gm) if on() else None
                start = time.perf_counter()
                compiled = original(self, gm, example_inputs)
                if after is not None:
                    after(compiled, time.perf_counter() - start)
                return compiled

            return call_user_compiler

        undos.append(_installs.patch(owner, _HANDOFF, make))

    _installs.register(HANDOFF_MODULE, wrap)

    def undo() -> None:
        _installs.unregister(HANDOFF_MODULE, wrap)
        while undos:
            undos.pop()()

    return undo
