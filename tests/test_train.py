"""End-to-end tests of ``jvpreg-train``: fast_dev_run per regularizer and model, the default run,
a multirun, and the error messages users hit first."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import InstantiationException

from conftest import once_more_if_a_spawned_worker_aborts_at_exit
from jvpreg.train import train

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def make_cfg(tmp_path, overrides=()):
    tmp = str(tmp_path)
    with initialize_config_module("jvpreg.conf", version_base="1.3"):
        return compose("train", overrides=[f"paths.root_dir={tmp}", f"paths.work_dir={tmp}",
                                           f"paths.output_dir={tmp}/out", "trainer.enable_progress_bar=false",
                                           *overrides])


def fdr(tmp_path, *overrides):
    """fast_dev_run (1 train/val/test batch), no loggers."""
    result, objects = train(make_cfg(tmp_path, ["debug=fdr", "logger=none", "hydra.verbose=false", *overrides]))
    return result, objects


REGULARIZERS = ["none", "jacobian", "tangent_prop", "constraint", "param_sensitivity", "spectral", "stacked"]


@pytest.mark.parametrize("reg", [r if r == "jacobian" else pytest.param(r, marks=pytest.mark.slow)
                                 for r in REGULARIZERS])
def test_fast_dev_run_every_regularizer(tmp_path, reg):
    result, objects = fdr(tmp_path, f"regularizer={reg}")
    names = [type(cb).__name__ for cb in objects["callbacks"]]
    n_reg = sum(n.endswith("Regularizer") for n in names)
    assert n_reg == {"none": 0, "stacked": 2}.get(reg, 1), names
    logged = set(result["history"][0])  # metrics at the end of the (one-batch) training epoch
    assert "train/loss" in logged
    if reg != "none":  # the regularizer logged its penalty
        assert any(k.startswith("train/") and k not in ("train/loss", "train/loss_step", "train/loss_epoch",
                                                        "train/acc") for k in logged), logged


MODELS = [
    ("mlp", []),
    ("small_cnn", []),
    ("rnn", []),
    ("unet", []),
    ("resnet18", ["data=synthetic", "data.in_channels=3", "data.size=32", "data.batch_size=4"]),  # in-place ReLUs
    ("lenet5", ["data.resize=16"]),
]


@pytest.mark.parametrize("model, extra", [pytest.param(m, e, marks=pytest.mark.slow) if m in ("mlp", "resnet18", "unet")
                                          else (m, e) for m, e in MODELS], ids=[m for m, _ in MODELS])
def test_fast_dev_run_models(tmp_path, model, extra):
    """Each model trains one batch with the Jacobian penalty applied: logged positive and finite, and the total loss
    is the task loss plus its weight times it."""
    result, objects = fdr(tmp_path, f"model={model}", "regularizer=jacobian", *extra)
    logged = result["history"][0]
    assert [type(cb).__name__ for cb in objects["callbacks"]].count("JacobianRegularizer") == 1
    penalty, weight = logged["train/jacobian_frobenius"], logged["train/jacobian_frobenius_weight"]
    assert 0 < penalty < float("inf") and weight > 0, logged
    assert logged["train/total_loss"] == pytest.approx(logged["train/loss_step"] + weight * penalty, rel=1e-6), logged


@pytest.mark.slow
def test_compile_true_compiles_the_network_in_place_and_regularizes_it_on_the_compiled_engine(tmp_path):
    from jvpreg.clone.program import capture

    result, objects = fdr(tmp_path, "model=mlp", "regularizer=jacobian", "compile=true")
    net = objects["lit"].net
    assert capture.compiled_in_place(net) and "train/loss" in result["history"][0]
    assert any(p.compiled is not None for p in capture.programs(net).values())
    assert not any(k.startswith("_orig_mod") or "._orig_mod." in k for k in objects["lit"].state_dict())


def test_compile_must_be_a_flag_or_torch_compile_arguments(tmp_path):
    with pytest.raises(ValueError, match="compile='fast': expected true/false or torch.compile's arguments"):
        fdr(tmp_path, "compile=fast")


@pytest.mark.slow
def test_jacobian_monitor_callback_config(tmp_path):
    result, objects = fdr(tmp_path, "callbacks=with_monitor", "callbacks.jacobian_monitor.every_n_epochs=1",
                          "callbacks.jacobian_monitor.k=2", "callbacks.jacobian_monitor.max_samples=2",
                          "callbacks.jacobian_monitor.plot=false")
    assert "JacobianMonitor" in [type(cb).__name__ for cb in objects["callbacks"]]
    assert "jacobian/fro" in result["history"][0] and "jacobian/sigma_1" in result["history"][0]


@pytest.mark.slow
def test_short_run_writes_checkpoint_metrics_and_plot(tmp_path):
    result, objects = train(make_cfg(tmp_path, [
        "logger=csv", "trainer.max_epochs=2", "trainer.limit_train_batches=4", "robustness.max_samples=64",
        "robustness.jacobian_max_samples=16", "robustness.pgd_steps=2"]))
    paths, metrics = result["paths"], result["metrics"]
    for key in ("best_checkpoint", "csv", "plot", "metrics_json"):
        assert os.path.isfile(paths[key]), key
    for key in ("test/acc", "val/acc_best", "robustness/clean_acc", "robustness/noise_acc@0.1",
                "robustness/fgsm_acc@0.1", "robustness/pgd_acc@0.05", "robustness/jacobian_fro"):
        assert key in metrics, key
    assert len(result["history"]) == 2
    ckpt = torch.load(paths["best_checkpoint"], map_location="cpu", weights_only=False)
    assert ckpt["jvpreg_config"]["model"]["name"] == "small_cnn"


# ---------------------------------------------------------------- entry points (subprocesses)


def _run(cmd, cwd, env_extra=None, timeout=420):
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": str(REPO)}
    env.update(env_extra or {})
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _entry(name):
    exe = shutil.which(name)
    return [exe] if exe else [sys.executable, "-m", {"jvpreg-train": "jvpreg.train", "jvpreg-eval": "jvpreg.evaluate"}[name]]


@pytest.mark.slow
def test_default_run_entry_point_wandb_offline(tmp_path):
    """The default config via the installed console script, from an unrelated folder, W&B offline."""
    out = tmp_path / "run"
    log = _run(_entry("jvpreg-train") + [f"hydra.run.dir={out}", "trainer.max_epochs=2", "robustness.pgd_steps=2"],
               cwd=tmp_path)
    assert "test accuracy" in log and "FGSM acc" in log and "||J||_F" in log and "Gaussian noise acc" in log
    assert (out / "checkpoints" / "best.ckpt").is_file()
    assert (out / "csv" / "metrics.csv").is_file()
    assert (out / "plots" / "summary.png").is_file()
    assert (out / ".hydra" / "config.yaml").is_file()
    assert glob.glob(str(out / "wandb" / "offline-run-*")), "no offline W&B run"
    assert str(out / "checkpoints" / "best.ckpt") in log  # the user is told where things are
    assert "wandb sync" in log
    result = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= result["metrics"]["test/acc"] <= 1.0


@pytest.mark.slow
def test_multirun_two_jobs_each_its_own_wandb_run(tmp_path):
    sweep = tmp_path / "sweep"
    _run([sys.executable, "-m", "jvpreg.train", "-m", "regularizer.weight=0,0.003", f"hydra.sweep.dir={sweep}",
          "trainer.max_epochs=1", "trainer.limit_train_batches=3", "robustness.enabled=false",
          "trainer.enable_progress_bar=false"], cwd=tmp_path)
    for job in ("0", "1"):
        assert (sweep / job / "checkpoints" / "best.ckpt").is_file()
        assert len(glob.glob(str(sweep / job / "wandb" / "offline-run-*"))) == 1
    regs = [json.loads((sweep / j / "metrics.json").read_text())["regularizer"] for j in ("0", "1")]
    assert regs == ["none", "jacobian(w=0.003)"]


# ---------------------------------------------------------------- errors


def test_unknown_model_name_lists_known_models(tmp_path):
    with pytest.raises(InstantiationException, match=r"Unknown model 'resnet_18'\. Did you mean 'resnet18'\?"):
        fdr(tmp_path, "model.name=resnet_18")


def test_model_too_large_for_the_data_says_resize(tmp_path):
    with pytest.raises(ValueError, match=r"model=vgg11 needs inputs of at least 32x32.*data.resize=32"):
        fdr(tmp_path, "model=vgg11")


def test_bad_regularizer_argument(tmp_path):
    with pytest.raises(InstantiationException, match=r"n_projections"):
        fdr(tmp_path, "regularizer.callbacks.jacobian.n_projections=0")
    with pytest.raises(InstantiationException, match=r"schedule"):
        fdr(tmp_path, "regularizer.callbacks.jacobian.schedule=sometimes")
    with pytest.raises(InstantiationException, match=r"unexpected keyword argument 'n_projection'"):
        fdr(tmp_path, "+regularizer.callbacks.jacobian.n_projection=2")


def test_offline_data_error(tmp_path):
    with pytest.raises(InstantiationException, match=r"MNIST not found under data_dir=[\s\S]*data\.download=true"):
        fdr(tmp_path, "data=mnist", f"data.data_dir={tmp_path}/nothing_here", "data.num_workers=0")


def test_tensorboard_missing_is_a_clear_error(tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        pytest.skip("tensorboard is installed")
    with pytest.raises(ImportError, match=r"pip install tensorboard"):
        train(make_cfg(tmp_path, ["debug=fdr", "logger=tensorboard"]))


# ---------------------------------------------------------------- slow


@pytest.mark.slow
def test_ddp_sim_two_cpu_processes(tmp_path):
    overrides = ["trainer=ddp_sim", "logger=csv", "trainer.max_epochs=1", "trainer.limit_train_batches=4",
                 "trainer.limit_val_batches=2", "robustness.max_samples=32", "robustness.jacobian_max_samples=8",
                 "robustness.pgd_steps=1"]
    runs = iter(["first", "retry"])
    result, objects = once_more_if_a_spawned_worker_aborts_at_exit(
        lambda: train(make_cfg(tmp_path / next(runs), overrides)))
    assert objects["trainer"].world_size == 2
    assert os.path.isfile(result["paths"]["best_checkpoint"])
    assert "test/acc" in result["metrics"] and "robustness/clean_acc" in result["metrics"]
