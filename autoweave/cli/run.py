"""``autoweave-run <command...>``: run a command with autoweave on (like ``ddtrace-run``)."""

from __future__ import annotations

import os
import shutil
import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write("usage: autoweave-run COMMAND [ARGS...]\n  runs COMMAND with AUTOWEAVE=1\n")
        return 0 if args else 2
    os.environ["AUTOWEAVE"] = "1"
    # Make the checkout's sitecustomize shell reachable too, for interpreters
    # that do not see the installed start-up file (e.g. a different venv's python -S).
    program = shutil.which(args[0]) or args[0]
    try:
        os.execvp(program, args)
    except OSError as exc:
        sys.stderr.write(f"autoweave-run: cannot run {args[0]!r}: {exc}\n")
        return 127
    return 0  # pragma: no cover - execvp does not return


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
