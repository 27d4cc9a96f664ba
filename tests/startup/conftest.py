"""Session fixtures for the start-up tests: one wheel, three child venvs, one probe script.

The venvs are real (``python -m venv``), and see the parent's torch, wrapt and pip
through path lines only; see ``venvs.py`` (shared with ``benchmarks/startup.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import venvs


@pytest.fixture(scope="session")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("autoweave-startup")


@pytest.fixture(scope="session")
def source(scratch: Path) -> Path:
    return venvs.source_tree(scratch)


@pytest.fixture(scope="session")
def wheel(source: Path, scratch: Path) -> Path:
    return venvs.build_wheel(source, scratch / "wheelhouse")


@pytest.fixture(scope="session")
def bare_venv(scratch: Path) -> venvs.Venv:
    return venvs.make_venv(scratch / "venv-bare")


@pytest.fixture(scope="session")
def installed_venv(scratch: Path, wheel: Path) -> venvs.Venv:
    venv = venvs.make_venv(scratch / "venv-installed")
    venvs.install_wheel(venv, wheel)
    return venv


@pytest.fixture(scope="session")
def editable_venv(scratch: Path, source: Path) -> venvs.Venv:
    venv = venvs.make_venv(scratch / "venv-editable")
    venvs.install_editable(venv, source)
    return venv


@pytest.fixture(params=["installed", "editable"])
def any_install(request: pytest.FixtureRequest) -> venvs.Venv:
    """Both install kinds: the wheel, and ``pip install -e``."""
    return request.getfixturevalue(f"{request.param}_venv")


@pytest.fixture(scope="session")
def probe_dir(scratch: Path) -> Path:
    """A directory holding a copy of ``awprobe.py``; scripts the tests write go here too."""
    directory = scratch / "probe"
    directory.mkdir()
    shutil.copy2(Path(__file__).with_name("awprobe.py"), directory / "awprobe.py")
    return directory
