"""``autoweave doctor``: would ``AUTOWEAVE=1`` activate autoweave in this interpreter, and if not, why.

Standard library only until the live check, which runs in a fresh subprocess.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import site
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from autoweave import _settings
from autoweave._settings import DISTRIBUTION

START_UP_FILES = ("autoweave.pth", "autoweave.start")
OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"

_LIVE_CHECK = (
    "import json, sys\n"
    "out = {'executable': sys.executable}\n"
    "try:\n"
    "    import torch, autoweave, autoweave.dispatch.patches as p\n"
    "    from autoweave import startup\n"
    "    out.update(patched=isinstance(torch.compile, p.AutoweaveWrapper), applied=p.applied(),\n"
    "               autoweave=autoweave.__file__, torch=torch.__version__,\n"
    "               off_reason=startup.off_reason())\n"
    "except Exception as exc:\n"
    "    out.update(patched=False, error=f'{type(exc).__name__}: {exc}')\n"
    "print('AUTOWEAVE-DOCTOR ' + json.dumps(out))\n"
)


@dataclass
class Check:
    status: str  # ok / warn / FAIL / info
    title: str
    detail: str = ""
    fix: str = ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except Exception:
        return None


def _tuple(raw: str) -> tuple[int, ...]:
    # The digits of each of the first three parts, 0 for a part without any.
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in raw.split(".")[:3])


def _read(path: str) -> str:
    return Path(path).read_text(encoding="utf-8", errors="replace")


def check_torch(version: str | None, untested: str | None = None) -> Check:
    """The installed torch against ``_compat.version.TESTED_TORCH``, as the start-up check judges it.

    pyproject only sets a lower bound (pip must not replace a newer torch). On a
    torch newer than tested, autoweave checks at start-up what it needs from it;
    the live check below runs that check in a fresh interpreter.
    """
    from autoweave import _compat

    low, high = _compat.version.TESTED_TORCH
    tested = f"tested: {low[0]}.{low[1]} to {high[0]}.{high[1]}"
    requirement = f"pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'"
    if version is None:
        return Check(FAIL, "torch is not installed", tested, requirement)
    if untested is None:
        untested = _settings.Settings.from_environ().untested_torch
    try:
        support = _compat.version.torch_support(version, untested=untested, check=list)
    except _compat.lookup.UnsupportedTorch as exc:
        return Check(FAIL, f"torch {version}", str(exc), requirement)
    if not support.untested and not support.on:
        return Check(
            FAIL,
            f"torch {version}",
            f"{tested}; with AUTOWEAVE=1 autoweave says so at start-up and stays off",
            f"install a supported torch ({requirement}), or unset AUTOWEAVE",
        )
    if support.untested and not support.on:  # AUTOWEAVE_UNTESTED_TORCH=off (nothing is checked here)
        return Check(
            FAIL,
            f"torch {version} (newer than tested)",
            f"{tested}; {_settings.AUTOWEAVE_UNTESTED_TORCH}=off keeps autoweave off on it",
            f"unset {_settings.AUTOWEAVE_UNTESTED_TORCH} to let autoweave check this torch, or {requirement}",
        )
    if support.untested:
        return Check(
            WARN,
            f"torch {version} (newer than tested)",
            f"{tested}; at start-up autoweave checks what it needs from this torch "
            "(the live check shows the verdict)",
        )
    return Check(OK, f"torch {version}", tested)


def check_versions() -> list[Check]:
    py = sys.version_info
    checks = [
        Check(OK, f"Python {py.major}.{py.minor}.{py.micro}", "supported: 3.10+")
        if py >= (3, 10)
        else Check(
            FAIL, f"Python {py.major}.{py.minor}", "autoweave needs Python 3.10+", "use Python 3.10 or newer"
        ),
        check_torch(_version("torch")),
    ]
    wrapt_version = _version("wrapt")
    supported = "supported: >=1.14, not 2.2.0"
    if wrapt_version is None or _tuple(wrapt_version) < (1, 14) or _tuple(wrapt_version) == (2, 2, 0):
        title = "wrapt is not installed" if wrapt_version is None else f"wrapt {wrapt_version}"
        detail = "needed to patch torch" if wrapt_version is None else supported
        checks.append(Check(FAIL, title, detail, "pip install 'wrapt>=1.14,!=2.2.0'"))
    else:
        checks.append(Check(OK, f"wrapt {wrapt_version}", supported))
    return checks


def site_dirs() -> list[tuple[str, str]]:
    """(directory, kind) for every directory whose .pth files Python reads at start-up."""
    dirs = [(d, "site-packages") for d in site.getsitepackages()]
    user = site.getusersitepackages()
    if user:
        dirs.append((user, "user site-packages"))
    return dirs


def _hidden(path: str) -> bool:
    if os.path.basename(path).startswith("."):
        return True
    flags = getattr(os.stat(path), "st_flags", 0)
    return bool(flags & getattr(stat, "UF_HIDDEN", 0))


def check_start_up_file() -> tuple[list[Check], bool]:
    """Is the start-up file where Python reads it? Returns the checks and whether one is usable."""
    dirs = site_dirs()
    paths = [(os.path.join(directory, name), kind) for directory, kind in dirs for name in START_UP_FILES]
    found = [(path, kind) for path, kind in paths if os.path.isfile(path)]
    usable = False
    checks = []
    if sys.flags.no_site:
        checks.append(
            Check(
                FAIL,
                "Python runs with -S (no site module)",
                "start-up files in site-packages are never read",
                "drop -S, or run with PYTHONPATH=<checkout>/sitecustomize",
            )
        )
    for path, kind in found:
        if path.endswith(".start") and sys.version_info < (3, 15):
            check = Check(INFO, path, "for Python 3.15+ (this Python reads autoweave.pth)")
        elif _hidden(path):
            check = Check(
                FAIL,
                f"start-up file is hidden: {path}",
                "Python skips hidden .pth files",
                f"clear the hidden flag (chflags nohidden {path})",
            )
        elif kind == "user site-packages" and (sys.flags.no_user_site or not site.ENABLE_USER_SITE):
            check = Check(
                FAIL,
                f"start-up file in the user site, which is off: {path}",
                "PYTHONNOUSERSITE or -s disables it",
                f"unset PYTHONNOUSERSITE / drop -s, or pip install {DISTRIBUTION} into the environment",
            )
        elif "autoweave" not in _read(path):
            check = Check(
                FAIL,
                f"start-up file is not autoweave's: {path}",
                "",
                f"pip install --force-reinstall {DISTRIBUTION}",
            )
        else:
            usable = not sys.flags.no_site
            check = Check(OK if usable else WARN, f"start-up file: {path}", f"in {kind}; read at start-up")
        checks.append(check)
    if not found:
        checks.append(
            Check(
                WARN,
                "no start-up file (autoweave.pth) in any site-packages of this Python",
                "searched: " + ", ".join(d for d, _ in dirs),
                f"pip install {DISTRIBUTION} into this environment, "
                "or run with PYTHONPATH=<checkout>/sitecustomize, or use `autoweave-run <command>`",
            )
        )
    return checks, usable


def other_distributions(path: list[str] | None = None) -> list[tuple[str, str]]:
    """(name, version) of installed distributions other than ours that ship an ``autoweave`` package.

    PyPI's ``autoweave`` is an unrelated project with a top-level ``autoweave/``:
    installed beside ours, one overwrites the other's files.
    """
    found = {}
    for dist in importlib.metadata.distributions(**({} if path is None else {"path": path})):
        name = dist.metadata.get("Name") or ""
        if name.lower().replace("_", "-") == DISTRIBUTION:
            continue
        top = (dist.read_text("top_level.txt") or "").split()
        # RECORD as written, not ``dist.files``: Python 3.11 drops files missing on disk,
        # and the other project's files may be ours now (one overwrote the other).
        record = (dist.read_text("RECORD") or "").splitlines()
        if "autoweave" in top or any(line.startswith("autoweave/") for line in record):
            found[name] = dist.version
    return sorted(found.items())


def check_other_distributions(path: list[str] | None = None) -> list[Check]:
    try:
        others = other_distributions(path)
    except Exception as exc:  # unreadable metadata must not stop the doctor
        return [Check(INFO, "installed distributions could not be read", repr(exc))]
    return [
        Check(
            FAIL,
            f"another distribution owns the autoweave import package: {name} {version}",
            f"it is not this autoweave ({DISTRIBUTION}); installed together, one overwrites the other's files",
            f"pip uninstall {name} && pip install --force-reinstall {DISTRIBUTION}",
        )
        for name, version in others
    ]


def check_sitecustomize() -> tuple[Check, bool]:
    """Which ``sitecustomize`` wins; returns whether it is autoweave's start-up shell."""
    try:
        spec = importlib.util.find_spec("sitecustomize")
    except Exception as exc:  # a broken sitecustomize on the path
        return Check(WARN, "sitecustomize cannot be located", repr(exc)), False
    if spec is None or not spec.origin:
        return Check(INFO, "sitecustomize: none on sys.path"), False
    origin = spec.origin
    try:
        text = _read(origin)
    except OSError:
        text = ""
    if "autoweave" in text and "_chain_shadowed" in text:
        return Check(
            OK, f"sitecustomize: autoweave's start-up shell {origin}", "it chains the one it shadows"
        ), True
    return Check(
        INFO, f"sitecustomize: {origin}", "not autoweave's; the start-up file does not need it"
    ), False


def check_settings(environ: dict[str, str] | None = None) -> list[Check]:
    env = dict(os.environ) if environ is None else environ
    settings = _settings.Settings.from_environ(env)
    raw = env.get(_settings.AUTOWEAVE)
    shown = ", ".join(
        f"{k}={v!r}" for k, v in settings.as_dict().items() if k != "problems" and v not in (None, [], False)
    )
    if settings.enabled:
        check = Check(OK, f"settings: on ({shown})")
    elif env.get(_settings.AUTOWEAVE_DISABLE, "").strip().lower() in _settings.TRUE_VALUES:
        disable = _settings.AUTOWEAVE_DISABLE
        check = Check(FAIL, f"{disable} is set: autoweave is hard off", "", f"unset {disable}")
    else:
        how = "not set" if raw is None else repr(raw)
        check = Check(
            INFO, f"settings: {_settings.AUTOWEAVE} is {how}: off in this shell", shown or "defaults"
        )
    problems = [
        Check(WARN, "invalid setting", p, "fix the value (see README, Switches)") for p in settings.problems
    ]
    return [check, *problems]


def live_check(timeout: float = 180.0, start_up_found: bool = False) -> Check:
    """Start a fresh interpreter with ``AUTOWEAVE=1``: is torch.compile patched there?"""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _LIVE_CHECK],
            env={**os.environ, _settings.AUTOWEAVE: "1"},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=os.path.expanduser("~") if os.path.isdir(os.path.expanduser("~")) else None,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(FAIL, "live check could not run", repr(exc), "run `python -c 'import torch'` to see why")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("AUTOWEAVE-DOCTOR ")]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return Check(
            FAIL, "live check: the fresh interpreter failed", " | ".join(tail), "see the error above"
        )
    result = json.loads(lines[-1].split(" ", 1)[1])
    if result.get("patched"):
        return Check(
            OK,
            "live check: a fresh python with AUTOWEAVE=1 has torch.compile patched",
            f"patches {', '.join(result.get('applied', []))}; autoweave from {result.get('autoweave')}",
        )
    why = result.get("error") or result.get("off_reason") or "torch.compile is not autoweave's wrapper"
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("autoweave:")]
    return Check(
        FAIL,
        "live check: a fresh python with AUTOWEAVE=1 is NOT patched",
        "; ".join(dict.fromkeys([why, *warnings[:3]])),
        _live_fix(result, start_up_found),
    )


def _live_fix(result: dict, start_up_found: bool) -> str:
    """The fix for a fresh interpreter that is not patched: its real cause, not a guess."""
    off_reason = result.get("off_reason") or ""
    if "[unsupported-torch]" in off_reason or "[missing-dependency]" in off_reason:
        # autoweave started and said why it stays off: that sentence carries its own fix.
        fix = off_reason.split("Fix: ", 1)[-1] if "Fix: " in off_reason else off_reason.rsplit(". ", 1)[-1]
        return fix.strip().rstrip(".")
    if result.get("error"):
        return f"the fresh interpreter could not import torch or autoweave; pip install {DISTRIBUTION}"
    if start_up_found:
        return "the start-up file is present but did not patch: run with AUTOWEAVE_LOG_LEVEL=debug to see why"
    return (
        f"install autoweave's start-up file (pip install {DISTRIBUTION}), "
        "or run with PYTHONPATH=<checkout>/sitecustomize"
    )


def run(*, live: bool = True) -> tuple[list[Check], bool]:
    """All checks, and whether activation would work."""
    versions = check_versions()
    start_up, usable = check_start_up_file()
    shell, shell_ours = check_sitecustomize()
    if shell_ours:
        for check in start_up:
            if check.title.startswith("no start-up file"):
                check.status, check.fix = INFO, ""
                check.detail += "; autoweave's sitecustomize shell starts it instead"
    checks = [*versions, *start_up, shell, *check_settings(), *check_other_distributions()]
    if live:
        checks.append(live_check(start_up_found=usable or shell_ours))
    # Without the live check, a start-up file or shell must be seen to call it working.
    return checks, not any(c.status == FAIL for c in checks) and (live or usable or shell_ours)


def format_checks(checks: list[Check], works: bool) -> str:
    lines = [f"autoweave doctor ({sys.executable})"]
    for check in checks:
        lines.append(f"  {check.status:<5} {check.title}")
        if check.detail:
            lines.append(f"        {check.detail}")
        if check.fix and check.status in (FAIL, WARN):
            lines.append(f"        fix: {check.fix}")
    if works:
        lines.append("result: AUTOWEAVE=1 activates autoweave in this Python")
    else:
        fixes = [c.fix for c in checks if c.status == FAIL and c.fix]
        lines.append(
            "result: AUTOWEAVE=1 would NOT activate autoweave here" + (f"; {fixes[0]}" if fixes else "")
        )
    return "\n".join(lines)


def main(live: bool = True) -> int:
    checks, works = run(live=live)
    sys.stdout.write(format_checks(checks, works) + "\n")
    return 0 if works else 1
