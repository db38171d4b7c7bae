"""The linter, in CI through the test suite: `ruff check` over the code with the configuration of pyproject.toml's
[tool.ruff] (lines of at most 120 characters, pyflakes, pycodestyle; the comments there say why). ruff comes with
the `test` extra (`make install`); a fix: `python -m ruff check --fix apcscore tests scripts benchmarks` where it is
safe, by hand otherwise (never `ruff format`: the code is wrapped by hand)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ["apcscore", "tests", "scripts", "benchmarks"]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                                reason="ruff is not installed: `make install` (the `test` extra) brings it")


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_the_code_passes_the_linter() -> None:
    proc = ruff(*CHECKED)
    assert proc.returncode == 0, f"ruff check {' '.join(CHECKED)} found:\n{proc.stdout}{proc.stderr}"


def test_the_configuration_is_the_one_in_force(tmp_path: Path) -> None:
    """pyproject.toml's rules apply (a clean run above is not a configuration that checks nothing): a line of 121
    characters and an undefined name are found, a line of 120 is not."""
    src = tmp_path / "sample.py"
    src.write_text(f"x = {'1' * 116}\ny = {'2' * 117}\nprint(undefined_name)\n")
    proc = ruff("--config", str(ROOT / "pyproject.toml"), "--output-format", "concise", src.name, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = sorted(line.split()[:2] for line in proc.stdout.splitlines() if line.startswith("sample.py:"))
    assert found == [["sample.py:2:121:", "E501"], ["sample.py:3:7:", "F821"]], proc.stdout
