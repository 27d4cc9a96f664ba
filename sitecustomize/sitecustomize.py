"""autoweave's start-up shell for checkouts that are not pip-installed.

Use: ``PYTHONPATH=<checkout>/sitecustomize AUTOWEAVE=1 torchrun train.py``.
It puts the checkout on ``sys.path``, runs autoweave's start-up, then runs the
``sitecustomize`` it shadows (Debian's system Python ships one; a user may have
their own), exactly once.
"""

import os
import sys


def _chain_shadowed() -> None:
    # Find the next sitecustomize on sys.path after this file's directory and
    # execute it under its real name, as Python would have without us.
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a broken user sitecustomize must not break Python either
        sys.stderr.write(f"autoweave: the shadowed sitecustomize {spec.origin} failed: {exc!r}\n")


def _start() -> None:
    if os.environ.get("AUTOWEAVE", "").strip().lower() in ("", "0", "false", "no", "off"):
        return
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        import autoweave  # noqa: F401 - an installed copy wins
    except ImportError:
        sys.path.insert(0, checkout)
    try:
        from autoweave.startup import startup
    except Exception as exc:
        sys.stderr.write(f"autoweave: cannot load autoweave from {checkout}: {exc!r}\n")
        return
    startup()


_start()
_chain_shadowed()
