"""The tools beside the runtime, which never imports them: ``python -m autoweave doctor|explain``
and ``autoweave-run`` (``commands``), the doctor, the plan explainer."""
