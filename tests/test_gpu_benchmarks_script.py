"""scripts/gpu_benchmarks.sh, the GPU tables' one command: it runs (--dry-run: on this CPU, tiny sizes), every part
under its own limit, every table packed where the device tool returns it, and the modules it runs import without
hydra or wandb (the GPU machine has neither)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_benchmarks.sh"
PARTS = {"gpu_tests": 60, "train_fp32": 90, "train_bf16": 75, "jvp_b32": 75, "meanflow": 40, "paper": 110}


def _run(*args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=2400)


def test_the_parts_fit_one_eight_minute_slot():
    text = SCRIPT.read_text()
    limits = {m.group(1): int(m.group(2)) for m in re.finditer(r"^step (\w+) (\d+) ", text, re.M)}
    assert limits == PARTS
    assert sum(limits.values()) <= 450  # 30 s of the 8 minutes left for start-up, the GPU check and packing


def test_gpu_benchmarks_needs_an_outdir():
    proc = _run()
    assert proc.returncode != 0 and "usage: gpu_benchmarks.sh [--dry-run] OUTDIR" in proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error where torch sees no GPU")
@pytest.mark.slow
def test_gpu_benchmarks_without_a_gpu_says_to_dry_run(tmp_path):
    proc = _run(str(tmp_path))
    assert proc.returncode == 2 and "use --dry-run on a CPU" in proc.stderr


@pytest.mark.slow
def test_benchmark_modules_import_without_hydra_or_wandb():
    code = ("import sys\n"
            "for m in ('hydra', 'omegaconf', 'wandb'):\n"
            "    sys.modules[m] = None  # import fails, as on the GPU machine\n"
            "import jvpreg, jvpreg.bench.capture, jvpreg.bench.train, jvpreg.bench.paper, jvpreg.bench.jvp\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.slow
def test_gpu_benchmarks_dry_run_runs_every_part_and_packs_its_tables(tmp_path):
    proc = _run("--dry-run", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (tmp_path / "gpu_benchmarks.log").read_text()
    for part in PARTS:
        assert f"=== {part}: rc=0 after" in log, log
    with tarfile.open(tmp_path / "gpu_tables.tar.gz") as tar:
        names = sorted(Path(n).name for n in tar.getnames() if n.endswith(".json"))
        assert names == ["bench_capture_cpu_b32.json", "bench_meanflow_cpu.json", "bench_train_cpu_bf16.json",
                         "bench_train_cpu_fp32.json",
                         "paper_cpu_reduced.json"]
        train = json.load(tar.extractfile("./bench_train_cpu_fp32.json"))
    assert {r["model"] for r in train["results"]} == {"resnet18", "vit", "mlp200"}
    assert {r["method"] for r in train["results"]} == {"plain", "plain_2b", "clone", "clone_rows25", "double_backprop"}
    assert all(r["status"] == "ok" and r.get("peak_bytes") for r in train["results"])
