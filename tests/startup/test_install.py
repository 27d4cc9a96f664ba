"""The start-up layer, end to end: real wheels, real venvs, real child processes.

Every check runs a fresh interpreter of a child venv (see ``conftest.py``), so what is
tested is what ``pip install autoweave`` and ``AUTOWEAVE=1`` do to a user's Python.
"""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import venvs
from venvs import parse_probe

ALL_PATCHES = ["checkpoint_wrapper", "compile", "module_compile"]
STARTUP_FILES = ("autoweave.pth", "autoweave.start", "_autoweave_start.py")
WATCHED = ("autoweave", "_autoweave_start", "wrapt", "torch")
INTERNAL_ERROR = re.compile(r"^autoweave\[rank ?\d+\]: \[internal-error\]", re.M)

pytestmark = pytest.mark.slow


def autoweave_lines(stderr: str) -> list[str]:
    """What autoweave wrote to stderr (torch may warn there too, e.g. without numpy)."""
    return [line for line in stderr.splitlines() if "autoweave" in line.lower()]


def run_probe(
    venv: venvs.Venv, probe_dir: Path, *flags: str, env: dict[str, str | None] | None = None
) -> tuple[dict, subprocess.CompletedProcess]:
    proc = venv.run([str(probe_dir / "awprobe.py"), *flags], env=venvs.child_env(env), cwd=probe_dir)
    assert proc.returncode == 0, proc.stderr
    payloads = parse_probe(proc.stdout)
    assert len(payloads) == 1, (proc.stdout, proc.stderr)
    return payloads[0], proc


def run_script(
    venv: venvs.Venv,
    probe_dir: Path,
    name: str,
    source: str,
    *args: str,
    env: dict[str, str | None] | None = None,
    timeout: float = 180,
) -> subprocess.CompletedProcess:
    script = probe_dir / name
    script.write_text(textwrap.dedent(source))
    return venv.run([str(script), *args], env=venvs.child_env(env), cwd=probe_dir, timeout=timeout)


def assert_original(state: dict) -> None:
    assert state["compile_is_function"], state
    assert state["compile_module"] == "torch"
    assert not state["compile_has_wrapped"]
    assert state["compile_layers"] == 0
    assert state["module_compile_is_function"] and state["module_compile_layers"] == 0
    if "cw_layers" in state:
        assert state["cw_is_function"] and state["cw_layers"] == 0
        assert state["cw_default_layers"][0] == 0


def assert_patched(state: dict) -> None:
    assert state["applied"] == ALL_PATCHES, state
    assert state["compile_type"] == "AutoweaveWrapper"
    assert state["compile_layers"] == 1
    assert state["module_compile_layers"] == 1
    assert state["cw_layers"] == 1
    # apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, ...)
    assert state["cw_default_layers"][0] == 1, state


# -- what gets installed -------------------------------------------------------------------


def test_startup_files_in_site_packages(any_install: venvs.Venv) -> None:
    for name in STARTUP_FILES:
        assert (any_install.site_packages / name).is_file(), name
    pth = (any_install.site_packages / "autoweave.pth").read_text().strip().splitlines()
    assert len(pth) == 1 and pth[0].startswith("import ")
    assert (any_install.site_packages / "autoweave.start").read_text().strip() == "_autoweave_start:main"


def test_bare_venv_has_no_startup_files(bare_venv: venvs.Venv) -> None:
    for name in STARTUP_FILES:
        assert not (bare_venv.site_packages / name).exists()
    proc = bare_venv.run(["-c", "import autoweave"])
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


# -- AUTOWEAVE unset -------------------------------------------------------------------------

CHECK_MODULES = f"import sys; print(sorted(m for m in {WATCHED!r} if m in sys.modules))"


@pytest.mark.parametrize("kind", ["bare", "installed", "editable"])
def test_unset_imports_nothing(kind: str, request: pytest.FixtureRequest) -> None:
    venv = request.getfixturevalue(f"{kind}_venv")
    proc = venv.run(["-c", CHECK_MODULES])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert autoweave_lines(proc.stderr) == [], proc.stderr


@pytest.mark.parametrize("value", [None, "", "0", "false", "No", " off "])
def test_off_values_import_nothing(installed_venv: venvs.Venv, value: str | None) -> None:
    proc = installed_venv.run(["-c", CHECK_MODULES], env=venvs.child_env({"AUTOWEAVE": value}))
    assert proc.stdout.strip() == "[]", proc.stderr
    assert autoweave_lines(proc.stderr) == [], proc.stderr


def test_unset_torch_is_original(any_install: venvs.Venv, probe_dir: Path) -> None:
    state, proc = run_probe(any_install, probe_dir, "torch", "cw")
    assert "autoweave" not in state["modules"]
    assert state["applied"] is None
    assert_original(state)
    assert autoweave_lines(proc.stderr) == [], proc.stderr


# -- AUTOWEAVE=1 -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_on_without_torch_imports_neither_torch_nor_wrapt(installed_venv: venvs.Venv, value: str) -> None:
    proc = installed_venv.run(["-c", CHECK_MODULES], env=venvs.child_env({"AUTOWEAVE": value}))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['_autoweave_start']"
    assert autoweave_lines(proc.stderr) == [], proc.stderr


def test_on_without_torch_editable(editable_venv: venvs.Venv) -> None:
    proc = editable_venv.run(["-c", CHECK_MODULES], env=venvs.child_env({"AUTOWEAVE": "1"}))
    assert proc.stdout.strip() == "['_autoweave_start']", proc.stderr


IS_ENABLED = "import autoweave; a = autoweave.is_enabled(); import torch; print(a, autoweave.is_enabled())"


@pytest.mark.parametrize("value, expected", [("1", "True True"), (None, "False False")])
def test_is_enabled_before_and_after_torch(
    installed_venv: venvs.Venv, value: str | None, expected: str
) -> None:
    # With AUTOWEAVE=1 the start-up file registers its hook itself: is_enabled() must know.
    env = venvs.child_env({} if value is None else {"AUTOWEAVE": value})
    proc = installed_venv.run(["-c", IS_ENABLED], env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected


def test_on_patches_torch(any_install: venvs.Venv, probe_dir: Path) -> None:
    state, proc = run_probe(any_install, probe_dir, "torch", "cw", env={"AUTOWEAVE": "1"})
    assert sorted(state["at_start"]) == ["_autoweave_start"]
    assert_patched(state)
    assert autoweave_lines(proc.stderr) == [], proc.stderr


def test_on_patches_checkpoint_wrapper_imported_first(installed_venv: venvs.Venv, probe_dir: Path) -> None:
    # The checkpoint_wrapper module imports torch itself: both hooks fire, in nested order.
    proc = run_script(
        installed_venv,
        probe_dir,
        "cw_first.py",
        """
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper  # noqa: F401
        import awprobe
        awprobe.emit(awprobe.state())
        """,
        env={"AUTOWEAVE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert_patched(parse_probe(proc.stdout)[0])


# -- children --------------------------------------------------------------------------------


def test_multiprocessing_children(installed_venv: venvs.Venv, probe_dir: Path) -> None:
    proc = run_script(
        installed_venv,
        probe_dir,
        "mp_children.py",
        """
        import multiprocessing as mp
        import sys

        import awprobe

        if __name__ == "__main__":
            # The parent never imports torch: each child gets patched by its own hooks
            # (fork: inherited ones; spawn and forkserver: its own start-up file).
            pending = {}
            pools = []
            for method in ("spawn", "fork", "forkserver"):
                pool = mp.get_context(method).Pool(1)
                pools.append(pool)
                pending[method] = pool.apply_async(awprobe.state_after_imports)
            results = {method: result.get(timeout=150) for method, result in pending.items()}
            for pool in pools:
                pool.close()
                pool.join()
            awprobe.emit({"parent_torch": "torch" in sys.modules, "children": results})
        """,
        env={"AUTOWEAVE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    payload = parse_probe(proc.stdout)[0]
    assert payload["parent_torch"] is False
    assert sorted(payload["children"]) == ["fork", "forkserver", "spawn"]
    for method, state in payload["children"].items():
        assert state["applied"] == ALL_PATCHES, method
        assert_patched(state)


def test_subprocess_children(installed_venv: venvs.Venv, probe_dir: Path) -> None:
    proc = run_script(
        installed_venv,
        probe_dir,
        "sp_children.py",
        """
        import subprocess
        import sys

        import awprobe

        # sys.executable and a plain "python" child both inherit AUTOWEAVE=1.
        child = subprocess.run(
            [sys.executable, "awprobe.py", "torch", "cw"], capture_output=True, text=True, check=True
        )
        sys.stdout.write(child.stdout)
        sys.stderr.write(child.stderr)
        awprobe.emit(awprobe.state())
        """,
        env={"AUTOWEAVE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    child, parent = parse_probe(proc.stdout)
    assert_patched(child)
    assert "torch" not in parent["modules"]


def test_torchrun_both_ranks(installed_venv: venvs.Venv, probe_dir: Path) -> None:
    script = probe_dir / "ranks.py"
    script.write_text(
        textwrap.dedent(
            """
            import os

            import awprobe

            state = awprobe.state_after_imports()
            state["rank"] = int(os.environ["RANK"])
            state["world_size"] = int(os.environ["WORLD_SIZE"])
            awprobe.emit(state)
            """
        )
    )
    proc = installed_venv.run(
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        env=venvs.child_env({"AUTOWEAVE": "1", "PYTHONPATH": str(probe_dir)}),
        cwd=probe_dir,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    states = sorted(parse_probe(proc.stdout), key=lambda s: s["rank"])
    assert [s["rank"] for s in states] == [0, 1], proc.stdout
    for state in states:
        assert state["world_size"] == 2
        assert_patched(state)
    assert not INTERNAL_ERROR.search(proc.stderr)


def test_torchrun_launcher_says_nothing_and_ranks_say_it_once(
    installed_venv: venvs.Venv, probe_dir: Path
) -> None:
    # torchrun's launcher inherits AUTOWEAVE and imports torch but never compiles: it stays
    # out; a problem with the settings (the same on every rank) is told once, by rank 0.
    script = probe_dir / "quiet.py"
    script.write_text("import torch  # noqa: F401\n")
    torchrun = venvs.console_script(
        "torchrun"
    )  # the script (wherever torch put it), run by the venv's python
    for launcher in (["-m", "torch.distributed.run"], [str(torchrun)]):
        proc = installed_venv.run(
            [*launcher, "--standalone", "--nproc_per_node=2", str(script)],
            env=venvs.child_env({"AUTOWEAVE": "1", "AUTOWEAVE_MODE": "sometimes"}),
            cwd=probe_dir,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = autoweave_lines(proc.stderr)
        assert len(lines) == 1 and "AUTOWEAVE_MODE='sometimes' not understood" in lines[0], proc.stderr


def test_the_wheel_is_torch_autoweave_and_holds_only_autoweave(wheel: Path) -> None:
    # "autoweave" on the package index is another project; ours installs as torch-autoweave.
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    assert "\nName: torch-autoweave\n" in text
    tops = {
        name.split("/", 1)[0] for name in names if not name.endswith(".dist-info/" + name.rsplit("/", 1)[-1])
    }
    assert tops == {"autoweave", *STARTUP_FILES}, tops


# -- switches --------------------------------------------------------------------------------


def test_disable_wins(installed_venv: venvs.Venv, probe_dir: Path) -> None:
    state, proc = run_probe(
        installed_venv, probe_dir, "torch", "cw", env={"AUTOWEAVE": "1", "AUTOWEAVE_DISABLE": "1"}
    )
    assert state["applied"] in (None, [])
    assert_original(state)
    assert autoweave_lines(proc.stderr) == [], proc.stderr


def test_invalid_autoweave_value(installed_venv: venvs.Venv, probe_dir: Path) -> None:
    state, proc = run_probe(installed_venv, probe_dir, "torch", "cw", env={"AUTOWEAVE": "maybe"})
    assert_original(state)
    lines = autoweave_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("autoweave: ")
    assert "AUTOWEAVE=" in line and "maybe" in line
    for accepted in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        assert accepted in line.split("accepted:")[1], line


def test_disabled_patches_compile(installed_venv: venvs.Venv, probe_dir: Path) -> None:
    state, proc = run_probe(
        installed_venv,
        probe_dir,
        "torch",
        "cw",
        env={"AUTOWEAVE": "1", "AUTOWEAVE_DISABLED_PATCHES": "compile"},
    )
    assert state["applied"] == ["checkpoint_wrapper", "module_compile"]
    assert state["compile_is_function"] and state["compile_layers"] == 0
    assert state["module_compile_layers"] == 1
    assert state["cw_layers"] == 1
    assert autoweave_lines(proc.stderr) == [], proc.stderr


def test_startup_file_run_twice_leaves_one_layer(installed_venv: venvs.Venv, probe_dir: Path) -> None:
    proc = run_script(
        installed_venv,
        probe_dir,
        "twice.py",
        """
        import os
        import site
        import sys

        import awprobe

        site_packages = sys.argv[1]
        with open(os.path.join(site_packages, "autoweave.pth")) as f:
            line = next(x for x in f if x.startswith("import"))

        with open(os.path.join(site_packages, "autoweave.start")) as f:
            # PEP 829 (Python 3.15): "module:callable" lines, run at start-up; a
            # venv's site-packages may be processed twice.
            entry = next(x.strip() for x in f if x.strip() and not x.startswith("#"))
        module_name, _, function = entry.partition(":")

        def rerun():
            exec(line, {})
            exec(line, {})
            site.addsitedir(site_packages)
            for _ in range(2):
                getattr(__import__(module_name), function)()

        rerun()  # before torch: hooks registered twice?
        import torch  # noqa: F401
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper  # noqa: F401
        before = awprobe.state()
        rerun()  # after torch: patched twice?
        import autoweave
        autoweave.enable()
        after = awprobe.state()
        import _autoweave_start
        hooks = {name: len(h) for name, h in _autoweave_start._hooks.items()}
        finders = sum(1 for f in sys.meta_path if type(f).__name__ == "_Finder")
        awprobe.emit({"before": before, "after": after, "hooks": hooks, "finders": finders})
        """,
        str(installed_venv.site_packages),
        env={"AUTOWEAVE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    payload = parse_probe(proc.stdout)[0]
    assert_patched(payload["before"])
    assert_patched(payload["after"])
    assert payload["finders"] == 1
    assert set(payload["hooks"].values()) == {1}, payload["hooks"]


def test_wrapper_is_transparent(installed_venv: venvs.Venv, probe_dir: Path) -> None:
    proc = run_script(
        installed_venv,
        probe_dir,
        "transparent.py",
        """
        import inspect

        import torch
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as cw
        from torch import compile as imported_compile

        import awprobe
        from autoweave.dispatch import patches

        out = {"state": awprobe.state()}
        pairs = {
            "compile": torch.compile,
            "module_compile": torch.nn.Module.__dict__["compile"],
            "checkpoint_wrapper": cw.checkpoint_wrapper,
        }
        for name, patched in pairs.items():
            orig = patches.original(name)
            out[name] = {
                "distinct": patched is not orig,
                "signature": str(inspect.signature(patched)) == str(inspect.signature(orig)),
                "signature_obj": inspect.signature(patched) == inspect.signature(orig),
                "doc": patched.__doc__ == orig.__doc__ and bool(orig.__doc__),
                "name": patched.__name__ == orig.__name__,
                "qualname": patched.__qualname__ == orig.__qualname__,
                "module": patched.__module__ == orig.__module__,
            }
        out["from_import_is_wrapper"] = imported_compile is torch.compile and isinstance(
            imported_compile, patches.AutoweaveWrapper
        )
        m = torch.nn.Linear(2, 2)
        out["bound_signature"] = str(inspect.signature(m.compile)) == str(
            inspect.signature(patches.original("module_compile").__get__(m))
        )
        awprobe.emit(out)
        """,
        env={"AUTOWEAVE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    out = parse_probe(proc.stdout)[0]
    assert_patched(out["state"])
    for name in ("compile", "module_compile", "checkpoint_wrapper"):
        assert out[name] == {
            "distinct": True,
            "signature": True,
            "signature_obj": True,
            "doc": True,
            "name": True,
            "qualname": True,
            "module": True,
        }, (name, out[name])
    assert out["from_import_is_wrapper"]
    assert out["bound_signature"]


def test_decorators_still_work(installed_venv: venvs.Venv, probe_dir: Path) -> None:
    proc = run_script(
        installed_venv,
        probe_dir,
        "decorators.py",
        """
        import torch

        import awprobe

        @torch.compile
        def plain(x):
            return x * 2 + 1

        @torch.compile(backend="eager")
        def eager(x):
            return torch.sin(x) + 1

        compiled_later = torch.compile(lambda x: x - 3, backend="eager")
        x = torch.arange(4.0)
        linear = torch.nn.Linear(2, 2)
        y = torch.ones(3, 2)
        compiled_module = torch.compile(linear, backend="eager")
        in_place = torch.nn.Linear(2, 2)
        in_place.compile(backend="eager")
        awprobe.emit(
            {
                "state": awprobe.state(),
                "plain": torch.equal(plain(x), x * 2 + 1),
                "eager": torch.allclose(eager(x), torch.sin(x) + 1),
                "later": torch.equal(compiled_later(x), x - 3),
                "module": torch.allclose(compiled_module(y), linear(y)),
                "module_type": type(compiled_module).__name__,
                "in_place": torch.allclose(in_place(y), in_place.forward(y)),
            }
        )
        """,
        env={"AUTOWEAVE": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = parse_probe(proc.stdout)[0]
    assert out["state"]["compile_layers"] == 1
    assert out["plain"] and out["eager"] and out["later"], out
    assert out["module"] and out["in_place"], out
    assert out["module_type"] == "OptimizedModule"
    assert not INTERNAL_ERROR.search(proc.stderr), proc.stderr


# -- fail-open -------------------------------------------------------------------------------

BREAKER = """
import os

# Test-only: break autoweave's patching before torch is imported (no change to autoweave/).
if os.environ.get("AW_TEST_BREAK"):
    import autoweave.dispatch.patches as _patches

    def _boom(*args, **kwargs):
        raise RuntimeError("injected failure in " + os.environ["AW_TEST_BREAK"])

    for _name in os.environ["AW_TEST_BREAK"].split(","):
        setattr(_patches, _name, _boom)
"""


@pytest.fixture
def breaker_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "breaker"
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(BREAKER)
    return directory


@pytest.mark.parametrize("broken", ["apply_torch", "apply_torch,apply_checkpoint_wrapper"])
def test_failure_in_patching_falls_open(
    installed_venv: venvs.Venv, probe_dir: Path, breaker_dir: Path, broken: str
) -> None:
    proc = run_script(
        installed_venv,
        probe_dir,
        "broken.py",
        """
        import torch
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper  # noqa: F401

        import awprobe

        state = awprobe.state()
        state["works"] = torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))
        awprobe.emit(state)
        """,
        env={"AUTOWEAVE": "1", "AW_TEST_BREAK": broken, "PYTHONPATH": str(breaker_dir)},
    )
    assert proc.returncode == 0, proc.stderr
    state = parse_probe(proc.stdout)[0]
    assert state["works"]
    assert state["compile_is_function"] and state["compile_layers"] == 0
    assert "compile" not in state["applied"]
    assert len(INTERNAL_ERROR.findall(proc.stderr)) == 1, proc.stderr
    assert "injected failure in apply_torch" in proc.stderr
    assert "AUTOWEAVE_STRICT=1" in proc.stderr


def test_failure_in_patching_raises_when_strict(
    installed_venv: venvs.Venv, probe_dir: Path, breaker_dir: Path
) -> None:
    proc = installed_venv.run(
        ["-c", "import torch"],
        env=venvs.child_env(
            {
                "AUTOWEAVE": "1",
                "AUTOWEAVE_STRICT": "1",
                "AW_TEST_BREAK": "apply_torch",
                "PYTHONPATH": str(breaker_dir),
            }
        ),
    )
    assert proc.returncode != 0
    assert "AutoweaveError" in proc.stderr
    assert "injected failure in apply_torch" in proc.stderr


# -- no install: the checkout's sitecustomize shell ----------------------------------------


def test_checkout_sitecustomize_chains_to_the_shadowed_one(
    bare_venv: venvs.Venv, probe_dir: Path, tmp_path: Path
) -> None:
    user = tmp_path / "user-site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("print('USER-SITECUSTOMIZE-RAN')\n")
    shell = venvs.REPO_ROOT / "sitecustomize"
    proc = bare_venv.run(
        [
            "-c",
            "import sys, torch, awprobe; import torch.distributed.algorithms._checkpoint.checkpoint_wrapper; "
            "import autoweave; s = awprobe.state(); s['autoweave_file'] = autoweave.__file__; "
            "s['sitecustomize_file'] = sys.modules['sitecustomize'].__file__; awprobe.emit(s)",
        ],
        env=venvs.child_env(
            {"AUTOWEAVE": "1", "PYTHONPATH": os.pathsep.join([str(shell), str(user), str(probe_dir)])}
        ),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("USER-SITECUSTOMIZE-RAN") == 1, proc.stdout
    state = parse_probe(proc.stdout)[0]
    assert_patched(state)
    assert Path(state["autoweave_file"]).resolve().is_relative_to(venvs.REPO_ROOT)
    assert Path(state["sitecustomize_file"]).resolve() == (user / "sitecustomize.py").resolve()
    assert autoweave_lines(proc.stderr) == [], proc.stderr


# -- autoweave-run ---------------------------------------------------------------------------


def test_autoweave_run(installed_venv: venvs.Venv, probe_dir: Path) -> None:
    runner = installed_venv.bin / "autoweave-run"
    assert runner.is_file()
    env = venvs.child_env({"PATH": f"{installed_venv.bin}{os.pathsep}{os.environ.get('PATH', '')}"})
    proc = subprocess.run(
        [str(runner), "python", "awprobe.py", "torch", "cw"],
        env=env,
        cwd=probe_dir,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert_patched(parse_probe(proc.stdout)[0])


def test_autoweave_run_usage(installed_venv: venvs.Venv) -> None:
    runner = str(installed_venv.bin / "autoweave-run")
    proc = subprocess.run([runner], capture_output=True, text=True, env=venvs.child_env(), timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stdout
    proc = subprocess.run(
        [runner, "no-such-program-autoweave"],
        capture_output=True,
        text=True,
        env=venvs.child_env(),
        timeout=60,
    )
    assert proc.returncode == 127 and "cannot run" in proc.stderr
