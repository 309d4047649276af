"""Sweep summaries (``jvpreg.summarize``, ``jvpreg-summarize``): one row per job, mean ± std over seeds,
unfinished jobs listed, and a real 2x2 multirun that summarises itself."""
from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from jvpreg.summarize import load_jobs, main, summarize_sweep

REPO = Path(__file__).resolve().parents[1]


def fake_job(root: Path, name: str, overrides, clean, jfro, pgd=None, elapsed=3.0):
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    metrics = {"test/acc": clean - 0.01, "val/acc_best": clean + 0.01, "robustness/clean_acc": clean,
               "robustness/noise_acc@0.1": clean - 0.1, "robustness/fgsm_acc@0.05": clean - 0.2,
               "robustness/jacobian_fro": jfro, "robustness/n_samples": 64}
    if pgd is not None:
        metrics["robustness/pgd_acc@0.05"] = pgd
    (job / "metrics.json").write_text(json.dumps({"metrics": metrics, "elapsed_s": elapsed, "seed": 0}))


@pytest.fixture
def sweep(tmp_path):
    """2 weights x 3 seeds, plus one job that never finished."""
    values = {}
    n = 0
    for w in ("0", "0.01"):
        for seed in (0, 1, 2):
            clean, jfro = 0.9 - 0.01 * seed + (0.02 if w == "0.01" else 0), (2.0 if w == "0" else 1.0) + 0.1 * seed
            fake_job(tmp_path, str(n), [f"regularizer.weight={w}", f"seed={seed}", "trainer.max_epochs=3"], clean,
                     jfro, pgd=0.5)
            values[(w, seed)] = (clean, jfro)
            n += 1
    (tmp_path / "6" / ".hydra").mkdir(parents=True)
    return tmp_path, values


@pytest.mark.slow
def test_rows_groups_and_files(sweep):
    root, values = sweep
    s = summarize_sweep(root)
    assert [j.name for j in s.jobs] == [str(i) for i in range(6)] and s.incomplete == ["6"]
    assert s.varying == ["regularizer.weight", "seed"] and s.common == {"trainer.max_epochs": "3"}
    assert s.columns == ["clean acc", "noise_acc@0.1", "fgsm_acc@0.05", "pgd_acc@0.05", "||J||_F",
                         "val acc (best)", "time (s)"]
    by_weight = {over["regularizer.weight"]: stats for over, stats in s.groups}
    for w in ("0", "0.01"):
        cleans = [values[(w, seed)][0] for seed in (0, 1, 2)]
        jfros = [values[(w, seed)][1] for seed in (0, 1, 2)]
        mean, std, n = by_weight[w]["clean acc"]
        assert n == 3 and mean == pytest.approx(sum(cleans) / 3) and std == pytest.approx(statistics.stdev(cleans))
        assert by_weight[w]["||J||_F"][:2] == pytest.approx((sum(jfros) / 3, statistics.stdev(jfros)))
    with open(s.paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and rows[4]["regularizer.weight"] == "0.01" and rows[4]["seed"] == "1"
    assert float(rows[4]["clean acc"]) == values[("0.01", 1)][0] and float(rows[4]["||J||_F"]) == values[("0.01", 1)][1]
    md = Path(s.paths["md"]).read_text()
    mean, std, _ = by_weight["0.01"]["clean acc"]
    assert "## Mean ± std over seeds" in md and f"| 0.01 | 3 | {mean:.4f} ± {std:.4f} |" in md
    assert "6 finished job(s), 1 without results: 6." in md and "`trainer.max_epochs=3`" in md
    assert os.path.getsize(s.paths["png"]) > 1000


def test_without_seed_sweep_there_is_no_seed_table(tmp_path):
    fake_job(tmp_path, "a", ["regularizer=jacobian"], 0.9, 1.0)
    fake_job(tmp_path, "b", ["regularizer=spectral"], 0.8, 0.5)
    s = summarize_sweep(tmp_path, plot=False)
    assert s.groups == [] and s.varying == ["regularizer"] and "png" not in s.paths
    assert "Mean ± std" not in Path(s.paths["md"]).read_text()


def test_runs_collected_anywhere_are_found_at_any_depth(tmp_path):
    fake_job(tmp_path, "outputs/train/2026-01-01_10-00-00", ["seed=0"], 0.9, 1.0)
    fake_job(tmp_path, "outputs/train/2026-01-01_11-00-00", ["seed=1"], 0.7, 1.0)
    jobs, incomplete = load_jobs(tmp_path)
    assert [j.overrides for j in jobs] == [{"seed": "0"}, {"seed": "1"}] and incomplete == []
    s = summarize_sweep(tmp_path, out_dir=tmp_path / "report", plot=False)
    assert s.groups[0][1]["clean acc"][:2] == pytest.approx((0.8, statistics.stdev([0.9, 0.7])))
    assert (tmp_path / "report" / "summary.md").is_file()


def test_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*nowhere' is not a folder\. Pass the sweep folder"):
        summarize_sweep(tmp_path / "nowhere")
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"no metrics\.json under .* \(job folders without results: 0\)"):
        summarize_sweep(tmp_path)
    assert main([str(tmp_path)]) == 2


@pytest.mark.slow
def test_command_line(sweep, capsys):
    root, _ = sweep
    assert main([str(root), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "| job | regularizer.weight | seed | clean acc |" in out and not (root / "summary.png").exists()
    proc = subprocess.run([sys.executable, "-m", "jvpreg.summarize", str(root)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (root / "summary.png").is_file() and f"png: {root / 'summary.png'}" in proc.stdout


@pytest.mark.slow
def test_two_by_two_multirun_writes_its_summary(tmp_path):
    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "jvpreg.train", "-m", "regularizer.weight=0,0.003", "seed=0,1",
         f"hydra.sweep.dir={sweep}", "logger=csv", "trainer.max_epochs=1", "trainer.limit_train_batches=3",
         "trainer.limit_val_batches=2", "robustness.max_samples=32", "robustness.jacobian_max_samples=4",
         "robustness.pgd_steps=1", "trainer.enable_progress_bar=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"jvpreg: sweep summary (4 jobs): {sweep / 'summary.md'}" in proc.stdout
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["regularizer.weight"], r["seed"]) for r in rows] == [("0", "0"), ("0", "1"), ("0.003", "0"),
                                                                   ("0.003", "1")]
    for r in rows:
        metrics = json.loads((sweep / r["job"] / "metrics.json").read_text())["metrics"]
        assert float(r["clean acc"]) == metrics["robustness/clean_acc"]
        assert float(r["||J||_F"]) == metrics["robustness/jacobian_fro"]
    md = (sweep / "summary.md").read_text()
    assert "## Mean ± std over seeds" in md and "\n| 0 | 2 | " in md and "\n| 0.003 | 2 | " in md
    assert (sweep / "summary.png").is_file()


def test_multirun_callback_reports_a_failed_summary_without_failing_the_sweep(tmp_path, caplog, capsys):
    from omegaconf import OmegaConf

    from jvpreg.train import SweepSummaryCallback

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with caplog.at_level("ERROR", logger="jvpreg.train"):
        SweepSummaryCallback().on_multirun_end(config)  # no jobs: logged, not raised
    assert "could not summarise the sweep" in caplog.text and f"jvpreg-summarize {tmp_path}" in caplog.text
    fake_job(tmp_path, "0", ["seed=0"], 0.9, 1.0)
    SweepSummaryCallback(plot=False).on_multirun_end(config)
    assert f"jvpreg: sweep summary (1 jobs): {tmp_path / 'summary.md'}" in capsys.readouterr().out
    with pytest.raises(TypeError, match=r"SweepSummaryCallback\(plot\): expected a bool, got 'yes'"):
        SweepSummaryCallback(plot="yes")
