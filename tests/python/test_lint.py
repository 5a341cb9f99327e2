"""The Python code passes its linter and type checker: ruff (pycodestyle and
pyflakes rules, ``ruff.toml``) over the package, the tests, the benches and
the scripts, and mypy over the package, both pinned in the project's
environment (``python/requirements-vllm.txt``), with vLLM and torch
installed so their types are checked too. Without that environment the
test skips, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KVTIER_BUILD_DIR", ROOT / "build"))
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.skipif(
    not (BIN / "ruff").exists() or not (BIN / "mypy").exists(),
    reason=("the project's environment (build/venv) with ruff and mypy is "
            "not here: " + ((BUILD / "venv.unavailable").read_text().strip()
                            if (BUILD / "venv.unavailable").exists()
                            else "run make venv")))


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_ruff_finds_nothing() -> None:
    paths = ["python/kvtier", "tests/python", "bench", "scripts"]
    r = _run([str(BIN / "ruff"), "check", "--no-cache",
              "--output-format", "concise", *paths], ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_finds_nothing_in_the_package() -> None:
    r = _run([str(BIN / "mypy"), "--ignore-missing-imports",
              "--no-incremental", "kvtier"], ROOT / "python")
    assert r.returncode == 0, r.stdout + r.stderr
