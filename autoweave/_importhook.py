"""Post-import hooks: the one finder lives in the top-level start-up module (see there)."""

import sys

import _autoweave_start as _start
from _autoweave_start import register, registered, unregister_all

__all__ = ["register", "registered", "unregister", "unregister_all"]


def unregister(name: str, hook: "_start.Hook") -> None:
    """Forget one hook; the finder leaves ``sys.meta_path`` with the last one.

    Written here, not in the start-up module: an editable install keeps its own
    copy of that module in site-packages, which may be older than this package.
    """
    with _start._lock:
        hooks = _start._hooks.get(name, [])
        if hook in hooks:
            hooks.remove(hook)
        if not hooks:
            _start._hooks.pop(name, None)
        if not _start._hooks and _start._finder in sys.meta_path:
            sys.meta_path.remove(_start._finder)
