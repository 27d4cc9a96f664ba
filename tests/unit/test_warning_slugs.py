"""Every warning slug autoweave writes is in README's table of warnings, and the table lists no other."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_CODE = [*(ROOT / "autoweave").rglob("*.py"), ROOT / "_autoweave_start.py"]
_NOT_SLUGS = {"arg-type", "attr-defined", "union-attr"}  # mypy's, in type: ignore comments


def slugs_in_code() -> set[str]:
    found: set[str] = set()
    for path in _CODE:
        text = path.read_text()
        found.update(re.findall(r"\[([a-z]+(?:-[a-z]+)+)\]", text))  # "[slug] message"
        found.update(re.findall(r'swallowed\(\s*"([a-z]+(?:-[a-z]+)+)"', text))  # the one guard's
    found.update(
        re.findall(r'"([a-z]+-torch)"', (ROOT / "autoweave" / "_compat" / "version.py").read_text())
    )  # tags
    return found - _NOT_SLUGS


def slugs_in_readme() -> set[str]:
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `")]
    return {m.group(1) for line in rows if (m := re.match(r"\| `([a-z]+(?:-[a-z]+)+)`", line))} - {
        "torch-autoweave",
    }


def test_every_slug_is_documented_and_every_documented_slug_exists() -> None:
    code, readme = slugs_in_code(), slugs_in_readme()
    assert code, "no slugs found: the pattern is wrong"
    assert code - readme == set(), f"slugs missing from README's warnings table: {sorted(code - readme)}"
    assert readme - code == set(), f"README documents slugs autoweave never writes: {sorted(readme - code)}"
