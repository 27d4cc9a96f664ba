"""Throw-away virtual environments for the start-up tests and the start-up benchmark.

One place for the recipe (``benchmarks/startup.py`` imports this file too):

* build the wheel once: ``python -m pip wheel --no-deps --no-build-isolation``;
* ``python -m venv --without-pip`` child environments that see the parent's packages
  (torch, wrapt, pip, hatchling, importlib_metadata) through one ``_parent_paths.pth``
  holding *path lines only*: the parent's own ``.pth`` files are not executed in the
  child, so an autoweave installed in the parent cannot leak into it. The lines name
  the parent's site-packages and, wherever else the parent found them (a ``.pth``
  line of its own, ``PYTHONPATH``, the user site), the directories that hold those
  packages (``PARENT_PACKAGES``), so the children see torch however the parent does;
* install with the parent's pip, run from the child interpreter, ``--no-index``
  (when the parent lacks the build backend, see ``can_build_in_place``, pip's index
  supplies it in an isolated build instead).

Standard library only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Files a wheel build needs; used only when the checkout cannot be built as it is.
_SOURCE_ITEMS = (
    "autoweave",
    "autoweave.pth",
    "autoweave.start",
    "_autoweave_start.py",
    "pyproject.toml",
    "sitecustomize",
)

AUTOWEAVE_VARIABLES_PREFIX = "AUTOWEAVE"


@dataclass(frozen=True)
class Venv:
    root: Path

    @property
    def bin(self) -> Path:
        return self.root / ("Scripts" if os.name == "nt" else "bin")

    @property
    def python(self) -> Path:
        return self.bin / ("python.exe" if os.name == "nt" else "python")

    @property
    def site_packages(self) -> Path:
        purelib = sysconfig.get_path("purelib", vars={"base": str(self.root), "platbase": str(self.root)})
        return Path(purelib)

    def run(self, args: list[str], *, env: dict[str, str] | None = None, timeout: float = 180, **kwargs):
        """Run ``<venv python> args...``; returns the CompletedProcess (text mode, captured).

        The working directory defaults to the venv itself, so ``-c`` never sees the checkout.
        """
        kwargs.setdefault("cwd", self.root)
        return subprocess.run(
            [str(self.python), *args],
            env=child_env() if env is None else env,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )


def child_env(
    overrides: dict[str, str | None] | None = None, *, keep_bytecode_flag: bool = True
) -> dict[str, str]:
    """``os.environ`` without anything that would change what a child's start-up does.

    Drops every ``AUTOWEAVE*`` variable, ``PYTHONPATH``, ``PYTHONSTARTUP``, ``PYTHONHOME``,
    ``PYTHONNOUSERSITE`` and ``VIRTUAL_ENV``; ``overrides`` set (or, with ``None``, remove) names.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(AUTOWEAVE_VARIABLES_PREFIX)
        and k not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONINSPECT")
    }
    if not keep_bytecode_flag:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in (overrides or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def source_tree(scratch: Path) -> Path:
    """The directory to build from: the checkout itself, or a staged copy when it lacks README.md.

    ``pyproject.toml`` names ``readme = "README.md"``; hatchling refuses to build without it.
    Until the README exists we build a copy of the package files with a placeholder README.
    """
    if (REPO_ROOT / "README.md").is_file():
        return REPO_ROOT
    staged = scratch / "autoweave-src"
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    for name in _SOURCE_ITEMS:
        src = REPO_ROOT / name
        if src.is_dir():
            shutil.copytree(src, staged / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            shutil.copy2(src, staged / name)
    (staged / "README.md").write_text("# autoweave\n\n(placeholder written by tests/startup/venvs.py)\n")
    return staged


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def can_build_in_place(editable: bool = False) -> bool:
    """Whether this interpreter has the build backend, so ``--no-build-isolation`` works.

    A developer's interpreter usually has hatchling; a CI venv made by ``pip install -e .``
    does not (pip built autoweave in an isolated environment), and then we let pip fetch
    the backend from its configured index the same way.
    """
    needed = ("hatchling", "editables") if editable else ("hatchling",)
    return all(importlib.util.find_spec(name) is not None for name in needed)


def build_wheel(source: Path, outdir: Path) -> Path:
    outdir.mkdir(parents=True, exist_ok=True)
    isolation = ["--no-build-isolation"] if can_build_in_place() else []
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(outdir), str(source)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    _check(proc, "building the wheel")
    wheels = sorted(outdir.glob("torch_autoweave-*.whl"))
    if not wheels:
        raise RuntimeError(f"no autoweave wheel in {outdir}: {proc.stdout}\n{proc.stderr}")
    return wheels[-1]


# What the children import from the parent: torch and what importing torch imports,
# wrapt, importlib_metadata, and pip with the build backends (hatchling, editables).
PARENT_PACKAGES = (
    "torch",
    "wrapt",
    "importlib_metadata",
    "pip",
    "hatchling",
    "editables",
    "typing_extensions",
    "filelock",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
    "numpy",
)


def _directory_holding(name: str) -> str | None:
    """The ``sys.path`` directory the top-level module ``name`` is found in (not imported), or None."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or ())
    if locations:  # a package: the directory above it
        return os.path.dirname(os.path.abspath(locations[0]))
    if spec.origin and os.path.isfile(spec.origin):  # a single-file module
        return os.path.dirname(os.path.abspath(spec.origin))
    return None


def parent_site_dirs() -> list[str]:
    """The directories a child sees: the parent's site-packages, then wherever else it found
    ``PARENT_PACKAGES`` (``site.getsitepackages()`` alone misses a torch reached through a
    ``.pth`` line). Never the checkout: the children must not import autoweave from it.
    """
    dirs = [os.path.abspath(p) for p in site.getsitepackages() if os.path.isdir(p)]
    checkout = os.path.abspath(REPO_ROOT)
    for name in PARENT_PACKAGES:
        directory = _directory_holding(name)
        if directory is not None and directory not in dirs and directory != checkout:
            dirs.append(directory)
    return dirs


def console_script(name: str, distribution: str = "torch") -> Path:
    """The parent's console script ``name`` of ``distribution`` (``torchrun``), wherever it was installed.

    Beside ``sys.executable`` in an ordinary venv; where the distribution's RECORD put it
    when the parent reaches that distribution through a ``.pth`` line (another
    environment's ``bin``); else the one on ``PATH``.
    """
    from importlib import metadata

    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return beside
    try:
        files = metadata.distribution(distribution).files or ()
    except metadata.PackageNotFoundError:
        files = ()
    for file in files:
        if file.name in (name, f"{name}.exe") and file.parent.name in ("bin", "Scripts"):
            located = Path(str(file.locate())).resolve()
            if located.is_file():
                return located
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"no {name} script of {distribution} beside {sys.executable} or on PATH")
    return Path(found)


def site_view(dest: Path, *, without: tuple[str, ...]) -> Path:
    """A directory of symlinks to everything in the parent's site-packages except ``without``.

    ``without`` holds distribution names (``wrapt``): the package, its
    ``.dist-info`` and any ``-stubs`` are left out, so importing it really fails
    (``ModuleNotFoundError``), as in an environment where it was never installed.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for directory in parent_site_dirs():
        for entry in Path(directory).iterdir():
            stem = entry.name.split("-", 1)[0].split(".", 1)[0].lower()
            if stem in without or (dest / entry.name).exists():
                continue
            (dest / entry.name).symlink_to(entry)
    return dest


def make_venv(root: Path, *, without: tuple[str, ...] = ()) -> Venv:
    """A ``--without-pip`` venv that sees the parent's site-packages as plain path entries.

    ``without``: distributions to hide from it (see ``site_view``).
    """
    proc = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    _check(proc, f"creating the venv {root}")
    venv = Venv(root)
    venv.site_packages.mkdir(parents=True, exist_ok=True)
    paths = [str(site_view(root / "parent-view", without=without))] if without else parent_site_dirs()
    (venv.site_packages / "_parent_paths.pth").write_text("".join(f"{p}\n" for p in paths))
    return venv


def pip_install(venv: Venv, *args: str, offline: bool = True) -> None:
    """``<venv python> -m pip install --no-deps`` (pip itself comes from the parent's path).

    ``offline``: ``--no-index --no-build-isolation``, everything from the parent.
    pip byte-compiles what it installs (its default), so timings see .pyc files.
    """
    flags = ["--no-index", "--no-build-isolation"] if offline else []
    proc = venv.run(
        ["-m", "pip", "install", "-q", "--no-deps", *flags, *args],
        env=child_env(keep_bytecode_flag=False),
        timeout=300,
    )
    _check(proc, f"pip install {' '.join(args)}")


def install_wheel(venv: Venv, wheel: Path) -> None:
    pip_install(venv, str(wheel))


def install_editable(venv: Venv, source: Path) -> None:
    pip_install(venv, "-e", str(source), offline=can_build_in_place(editable=True))


def parse_probe(stdout: str) -> list[dict]:
    """Every ``PROBE {json}`` line (written by ``awprobe.emit``) of ``stdout``, in order."""
    return [json.loads(line[len("PROBE ") :]) for line in stdout.splitlines() if line.startswith("PROBE ")]
