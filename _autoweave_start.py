"""Start-up entry point named by ``autoweave.start`` (PEP 829, Python 3.15+).

Standard library only, and imports the package only when ``AUTOWEAVE`` asks for it.
"""

import os


def main() -> None:
    if os.environ.get("AUTOWEAVE", "").strip().lower() in ("", "0", "false", "no", "off"):
        return
    try:
        from autoweave._bootstrap import startup
    except Exception:  # never break interpreter start-up
        return
    startup()
