"""The Makefile installs into a virtual environment it makes itself, or the active one, and
keeps its install stamp inside that environment: a second environment gets its own
install instead of being told it has one. Checked with `make -n` (what make would run)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def make_n(target: str, **variables: str) -> str:
    make = shutil.which("make")
    assert make, "make is required (the README's commands are make targets)"
    result = subprocess.run(
        [make, "-n", "-C", str(ROOT), target, *(f"{k}={v}" for k, v in variables.items())],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def environment(path: Path, installed: bool) -> Path:
    """A directory make takes for a virtual environment, with or without kvrs' stamp."""
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").touch()
    if installed:
        (path / ".kvrs-installed").touch()
    return path


def test_a_fresh_clone_creates_its_venv_and_installs_into_it(tmp_path):
    venv = tmp_path / "fresh-venv"
    plan = make_n("install", VENV=str(venv))
    assert f"python3 -m venv {venv}" in plan
    assert f"{venv}/bin/python -m pip install -q -e '.[dev]'" in plan
    assert f"touch {venv}/.kvrs-installed" in plan


@pytest.mark.parametrize("target", ["test", "demo", "lint"])
def test_the_stamp_belongs_to_the_environment_not_the_clone(tmp_path, target):
    installed = environment(tmp_path / "a", installed=True)
    other = environment(tmp_path / "b", installed=False)
    plan_installed = make_n(target, VIRTUAL_ENV=str(installed))
    assert "pip install" not in plan_installed
    assert f"{installed}/bin/python -m" in plan_installed
    plan_other = make_n(target, VIRTUAL_ENV=str(other))
    assert f"{other}/bin/python -m pip install -q -e '.[dev]'" in plan_other
