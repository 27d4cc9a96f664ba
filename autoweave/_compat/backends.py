"""The backend ``torch.compile`` builds from its arguments, and wrapping it without changing what compiles.

Torch range: ``torch._TorchCompileInductorWrapper`` / ``torch._TorchCompileWrapper``
and ``torch._dynamo.backends.registry.lookup_backend`` on 2.11-2.15 (the inductor
wrapper takes a ``name`` on newer releases, and a backend's ``_dynamo_backend_init`` hook is
2.15+). torch.compile has no public "build the backend for these arguments";
no upstream issue asks for one that we found. Why a wrapper must compare as the
backend it wraps: dynamo reuses a frame's graphs only for an equal backend, and
recompiles everything for a backend built anew (pytorch#168373, open).
"""

from __future__ import annotations

from typing import Any

from autoweave._compat.lookup import UnsupportedTorch


def lookup_backend(backend: Any) -> Any:
    """A backend by name, as torch.compile resolves it (``aot_eager`` -> its callable)."""
    from torch._dynamo.backends.registry import lookup_backend as lookup

    return lookup(backend)


def compile_backend(
    backend: Any, mode: str | None, options: dict | None, dynamic: Any, name: str | None
) -> Any:
    """The backend callable ``torch.compile(..., backend=, mode=, options=)`` would build.

    Lets the report wrap it (to count graphs) and hand ``torch.compile`` the
    wrapper with ``mode``/``options`` removed, compiling exactly the same way.
    """
    import torch

    if mode is None and options is None:
        mode = "default"
    if backend is None or backend == "inductor":
        wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        if wrapper is None:
            raise UnsupportedTorch("torch._TorchCompileInductorWrapper is missing")
        try:
            return wrapper(mode, options, dynamic, name)
        except TypeError:  # torch before the `name` argument
            return wrapper(mode, options, dynamic)
    wrapper = getattr(torch, "_TorchCompileWrapper", None)
    if wrapper is None:
        raise UnsupportedTorch("torch._TorchCompileWrapper is missing")
    return wrapper(backend, mode, options, dynamic)


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


class BackendWrapper(ForwardsToInner):
    """A backend around ``inner`` that dynamo treats as ``inner``: same name, equal when it is.

    dynamo matches a frame's cached graphs to the current backend with ``==``;
    torch builds a fresh ``_TorchCompileWrapper`` at every ``torch.compile`` and
    shares graphs because equal ones compare equal. A wrapper per compile that
    compared unequal would make identical layers compiled one by one recompile
    their shared code until the recompile limit, then run eager.
    """

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and bool(self.inner == other.inner)  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(type(self.inner))  # equal wrappers wrap equal backends, of one type


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
