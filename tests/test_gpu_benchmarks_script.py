"""scripts/gpu_benchmarks.sh, the GPU tables' runbook: its commands run (SMOKE=1: on this CPU, tiny sizes), every
table is packed where the device tool returns it, and the modules it runs import without hydra or wandb (the GPU
machine has neither)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_benchmarks.sh"


def _run(part: str, out: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), part, str(out)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=1500)


def test_gpu_benchmarks_refuses_an_unknown_part(tmp_path):
    proc = _run("5", tmp_path)
    assert proc.returncode == 2 and "PART must be 1, 2, 3 or 4, got '5'" in proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error where torch sees no GPU")
def test_gpu_benchmarks_without_a_gpu_says_to_use_smoke(tmp_path):
    proc = _run("1", tmp_path, SMOKE="0")
    assert proc.returncode == 2 and "use SMOKE=1" in proc.stderr


def test_benchmark_modules_import_without_hydra_or_wandb():
    code = ("import sys\n"
            "for m in ('hydra', 'omegaconf', 'wandb'):\n"
            "    sys.modules[m] = None  # import fails, as on the GPU machine\n"
            "import jvpreg, jvpreg.bench.capture, jvpreg.bench.train, jvpreg.bench.paper, jvpreg.bench.jvp\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.slow
def test_gpu_benchmarks_part_one_runs_and_packs_its_tables(tmp_path):
    proc = _run("1", tmp_path, SMOKE="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (tmp_path / "gpu_part1.log").read_text()
    assert log.count("rc=0 after") == 4, log  # the GPU tests (skipped on the CPU) and three benchmarks
    assert "=== gpu_tests: rc=0" in log and "no GPU here: the CPU's accelerator path stands in" in log, log
    with tarfile.open(tmp_path / "gpu_part1.tar.gz") as tar:
        names = sorted(Path(n).name for n in tar.getnames() if n.endswith(".json"))
        assert names == ["bench_capture_gpu_bf16.json", "bench_capture_gpu_fp32.json", "bench_capture_small_fp32.json"]
        bf16 = json.load(tar.extractfile("./bench_capture_gpu_bf16.json"))
    assert bf16["meta"]["autocast"] == "bf16"
    assert [r["model"] for r in bf16["rows"]] == ["resnet50", "vit_b_16", "densenet121"]
    assert all(r["rel_diff"]["captured"] == 0.0 for r in bf16["rows"])
