"""Command-line tools: ``python -m autoweave doctor|explain``, ``autoweave-run`` (in ``__main__``)."""
