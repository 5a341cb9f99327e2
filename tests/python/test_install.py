"""The package installs from the build tree into a virtualenv (no registry)
and works from there, away from the checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import BUILD, ROOT


def test_install_into_a_virtualenv_and_use_it(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip",
                    "--system-site-packages", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(ROOT / "scripts" / "install_python.sh"), "--build",
                    str(BUILD), "--python", str(py)], check=True, timeout=120)
    code = ("import kvtier, sys; "
            "ns = kvtier.Namespace('m', 'fp16', 1, 1, 8, 4); "
            "assert kvtier.hash_tokens(ns, range(8)).shape == (2, 2); "
            "assert kvtier.__file__.startswith(sys.prefix), kvtier.__file__; "
            "print(kvtier.__file__)")
    out = subprocess.run([str(py), "-c", code], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert str(venv) in out.stdout


def test_install_refuses_an_interpreter_of_another_abi(tmp_path: Path) -> None:
    """An interpreter whose ABI is not the extension's is refused, saying
    which was built and which was given (here a stand-in that reports
    another Python version)."""
    fake = tmp_path / "python9"
    fake.write_text("#!/bin/sh\necho cpython-39-x86_64-linux-gnu\n")
    fake.chmod(0o755)
    out = subprocess.run([str(ROOT / "scripts" / "install_python.sh"),
                          "--build", str(BUILD), "--python", str(fake),
                          "--target", str(tmp_path / "t")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "cpython-39-x86_64-linux-gnu" in out.stderr
    assert "is built for cpython-311" in out.stderr
    assert not (tmp_path / "t" / "kvtier").exists()
