"""``python -m autoweave doctor`` in real venvs: non-zero without the start-up file, zero with it."""

from __future__ import annotations

import venvs


def test_doctor_fails_in_a_venv_without_the_start_up_file(bare_venv: venvs.Venv) -> None:
    # The package is importable (the checkout on PYTHONPATH) but no autoweave.pth is installed.
    proc = bare_venv.run(
        ["-m", "autoweave", "doctor"], env=venvs.child_env({"PYTHONPATH": str(venvs.REPO_ROOT)})
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no start-up file (autoweave.pth)" in proc.stdout
    assert "is NOT patched" in proc.stdout
    assert "result: AUTOWEAVE=1 would NOT activate autoweave here; install" in proc.stdout


def test_doctor_passes_in_a_venv_with_the_start_up_file(any_install: venvs.Venv) -> None:
    proc = any_install.run(["-m", "autoweave", "doctor"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"start-up file: {any_install.site_packages / 'autoweave.pth'}" in proc.stdout
    assert "has torch.compile patched" in proc.stdout
