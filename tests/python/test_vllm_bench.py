"""The real-vLLM benchmark's smoke run (bench/vllm_bench.py --quick: the
offloading tier against vLLM's filesystem tier, small): it runs and prints
each figure beside its reference."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import BUILD, ROOT, engine_env

_why = BUILD / "venv.unavailable"
pytest.importorskip(
    "vllm", reason=(_why.read_text().strip() if _why.exists() else
                    "vLLM is not installed (scripts/setup_venv.sh)"))


def test_the_vllm_bench_smoke_run() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vllm_bench.py"), "--quick"],
        capture_output=True, text=True, timeout=300, env=engine_env())
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if "rows/s" in ln]
    assert [ln.split()[0] for ln in lines] == ["kvtier", "vLLM"], out.stdout
    assert all("of fs" in ln for ln in lines)
