"""``python -m autoweave``: the command-line tools (``autoweave.tools.commands``)."""

from autoweave.tools.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
