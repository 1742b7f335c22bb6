"""benchmarks/gpu_check.py, the script a GPU machine runs, on the CPU: every row it prints must hold here too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.slow
def test_the_gpu_check_passes_every_row_on_the_cpu(tmp_path):
    env = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--json"], capture_output=True, text=True,
                         timeout=600, env=env, cwd=SCRIPT.parent)
    report = json.loads(out.stdout)
    rows = {r["check"]: r for r in report["rows"]}
    assert list(rows) == ["bench", "offload", "int8", "nf4", "swarm"]
    assert out.returncode == 0 and all(r["ok"] for r in rows.values()), rows
    assert "equal transformers'" in rows["swarm"]["figure"]


@pytest.mark.slow  # runs the script in a process of its own
def test_the_gpu_check_says_what_to_do_without_cuda():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], capture_output=True, text=True, timeout=120,
                         cwd=SCRIPT.parent)
    assert out.returncode == 1 and "--device cpu" in out.stderr and "Traceback" not in out.stderr
