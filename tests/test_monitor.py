"""Tests for jvpreg.callbacks.monitor.JacobianMonitor (tiny Trainer runs on CPU)."""
from __future__ import annotations

import csv
import os
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, WandbLogger
from torch.utils.data import DataLoader, Dataset, TensorDataset

from jvpreg.analysis import top_singular_values
from jvpreg.callbacks.monitor import JacobianMonitor
from jvpreg.models import build_model

K = 3


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny models: one intra-op thread is as fast and far more robust on a shared, oversubscribed CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class TinyModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = build_model("small_cnn", in_channels=1, num_classes=3, image_size=8, width=4)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = (batch["image"], batch["label"]) if isinstance(batch, dict) else batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _data(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


class DictData(Dataset):
    def __init__(self):
        self.inner = _data()

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        x, y = self.inner[i]
        return {"image": x, "label": y}


def _fit(tmp_path, callback, *, val=None, max_epochs=1, module=None):
    trainer = pl.Trainer(accelerator="cpu", max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=1,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         logger=CSVLogger(str(tmp_path)), callbacks=[callback], num_sanity_val_steps=0)
    module = module or TinyModule()
    val = val if val is not None else DataLoader(_data(seed=1), batch_size=4)
    trainer.fit(module, DataLoader(_data(), batch_size=4), val)
    return trainer, module


def _metrics(trainer):
    with open(os.path.join(trainer.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    return [{k: v for k, v in r.items() if v != ""} for r in rows]


@pytest.mark.slow
def test_monitor_logs_metrics_and_writes_png(tmp_path):
    cb = JacobianMonitor(k=K, n_samples=8, max_samples=3)
    trainer, module = _fit(tmp_path, cb)
    rows = [r for r in _metrics(trainer) if "jacobian/sigma_1" in r]
    assert len(rows) == 1
    expected = {f"jacobian/sigma_{i}" for i in range(1, K + 1)} | {
        "jacobian/fro", "jacobian/fro_stderr", "jacobian/cond_k", "jacobian/residual", "jacobian/converged"}
    assert expected <= set(rows[0])
    sig = [float(rows[0][f"jacobian/sigma_{i}"]) for i in range(1, K + 1)]
    assert sig == sorted(sig, reverse=True) and sig[-1] > 0
    assert float(rows[0]["jacobian/cond_k"]) >= 1.0
    assert float(rows[0]["jacobian/fro"]) >= sig[0] * 0.5 and float(rows[0]["jacobian/fro_stderr"]) > 0
    # the PNG is in the logger's directory
    assert cb.last_plot_path == os.path.join(trainer.log_dir, "jacobian_spectrum_epoch000.png")
    with open(cb.last_plot_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # logged values are those of the cached first validation batch (3 rows)
    x = next(iter(DataLoader(_data(seed=1), batch_size=4)))[0][:3]
    module.eval()
    ref = top_singular_values(module, x, K, tol=1e-6, generator=torch.Generator().manual_seed(5)).values.mean(0)
    torch.testing.assert_close(torch.tensor(sig), ref.float(), rtol=1e-3, atol=0)
    assert cb.state_dict() == {"val_epochs_seen": 1, "n_computed": 1, "batch_index": 0, "last_epoch": 0}


def test_monitor_restores_train_mode_and_leaves_grads(tmp_path):
    module = TinyModule()
    cb = JacobianMonitor(k=2, n_samples=4, plot=False)
    seen = {}

    class Spy(pl.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            seen["bn_training"] = pl_module.net.features[0][1].training

    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=1, limit_val_batches=1,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         logger=False, callbacks=[cb, Spy()], num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(_data(), batch_size=4), DataLoader(_data(), batch_size=4))
    assert seen["bn_training"] is False                  # Lightning's eval mode kept during validation
    assert module.training                               # and train mode restored after it
    assert cb.last_plot_path is None and "jacobian/sigma_2" in cb.last_metrics


@pytest.mark.slow
def test_monitor_user_batch_dict_batches_and_every_n(tmp_path):
    x = torch.randn(2, 1, 8, 8)
    x0 = x.clone()
    cb = JacobianMonitor(k=2, n_samples=4, batch=x, every_n_epochs=2, plot_dir=tmp_path / "plots")
    trainer, _ = _fit(tmp_path, cb, val=DataLoader(DictData(), batch_size=4), max_epochs=2)
    assert torch.equal(x, x0)
    assert cb.state_dict()["val_epochs_seen"] == 2 and cb.state_dict()["n_computed"] == 1
    assert sorted(os.listdir(tmp_path / "plots")) == ["jacobian_spectrum_epoch001.png"]
    # dict batches: the default input finder uses the "image" key
    cb2 = JacobianMonitor(k=2, n_samples=4, plot=False)
    _fit(tmp_path / "b", cb2, val=DataLoader(DictData(), batch_size=4))
    assert cb2.state_dict()["n_computed"] == 1


def test_monitor_unknown_batch_layout_asks_for_input_fn(tmp_path):
    class Weird(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.inner = TinyModule()

        def forward(self, x):
            return self.inner(x)

        def training_step(self, batch, batch_idx):
            return self.inner.training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            pass

        def configure_optimizers(self):
            return self.inner.configure_optimizers()

    class Odd(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"pixels": torch.randn(1, 8, 8)}

    with pytest.raises(TypeError, match=r"cannot find the model input.*Pass input_fn="):
        _fit(tmp_path, JacobianMonitor(k=2, n_samples=4), val=DataLoader(Odd(), batch_size=4), module=Weird())
    cb = JacobianMonitor(k=2, n_samples=4, plot=False, input_fn=lambda b: b["pixels"])
    _fit(tmp_path / "ok", cb, val=DataLoader(Odd(), batch_size=4), module=Weird())
    assert cb.state_dict()["n_computed"] == 1


def test_monitor_state_dict_round_trip():
    cb = JacobianMonitor(k=2, every_n_epochs=3)
    state = {"val_epochs_seen": 5, "n_computed": 1, "batch_index": 0, "last_epoch": 2}
    cb.load_state_dict(state)
    assert cb.state_dict() == state
    other = JacobianMonitor(k=4, every_n_epochs=3)
    assert cb.state_key != other.state_key and cb.state_key.startswith("JacobianMonitor")
    assert cb.state_key == JacobianMonitor(k=2, every_n_epochs=3).state_key


def test_monitor_logs_image_to_wandb_loggers(tmp_path):
    calls = []

    class FakeWandb(WandbLogger):
        def __init__(self):  # no wandb run
            pass

        def log_image(self, key, images, step=None, **kwargs):
            calls.append((key, images, step))

    png = tmp_path / "x.png"
    png.write_bytes(b"")
    trainer = SimpleNamespace(loggers=[CSVLogger(str(tmp_path)), FakeWandb()], global_step=7)
    JacobianMonitor()._log_image(trainer, str(png))
    assert calls == [("jacobian/spectrum", [str(png)], 7)]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(k=0), ValueError, r"JacobianMonitor\(k=\.\.\.\): expected an int >= 1, got 0"),
    (dict(k=2.0), ValueError, r"JacobianMonitor\(k=\.\.\.\): expected an int >= 1, got 2.0"),
    (dict(every_n_epochs=0), ValueError, r"every_n_epochs=\.\.\.\): expected an int >= 1, got 0"),
    (dict(n_samples=1), ValueError, r"n_samples=\.\.\.\): expected an int >= 2, got 1"),
    (dict(fro_method="exact"), ValueError, r"fro_method=\.\.\.\): expected one of \('hutchinson', 'hutch\+\+'\), got 'exact'"),
    (dict(fro_method="hutch++", n_samples=3), ValueError, r"fro_method='hutch\+\+' needs n_samples >= 4, got 3"),
    (dict(max_samples=0), ValueError, r"max_samples=\.\.\.\): expected an int >= 1, got 0"),
    (dict(batch=[1.0, 2.0]), TypeError, r"batch=\.\.\.\): expected a floating-point tensor of shape \(B, \*in_shape\) with B >= 1, got list"),
    (dict(batch=torch.zeros(2, 3, dtype=torch.long)), TypeError, r"got a torch.int64 tensor of shape \(2, 3\)"),
    (dict(input_fn="x"), TypeError, r"input_fn=\.\.\.\): expected a callable or None, got str"),
    (dict(forward_fn=3), TypeError, r"forward_fn=\.\.\.\): expected a callable or None, got int"),
    (dict(tol=-1), ValueError, r"tol=\.\.\.\): expected a finite number >= 0, got -1"),
    (dict(max_iter=0), ValueError, r"max_iter=\.\.\.\): expected an int >= 1, got 0"),
    (dict(oversample=-1), ValueError, r"oversample=\.\.\.\): expected an int >= 0, got -1"),
    (dict(engine="jax"), ValueError, r"engine=\.\.\.\): expected one of \('clone', 'torch.func'\), got 'jax'"),
    (dict(plot="yes"), TypeError, r"plot=\.\.\.\): expected a bool, got str"),
    (dict(plot_dir=3), TypeError, r"plot_dir=\.\.\.\): expected a path or None, got int"),
    (dict(seed=-1), ValueError, r"seed=\.\.\.\): expected an int >= 0, got -1"),
])
def test_monitor_argument_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        JacobianMonitor(**kwargs)


def test_monitor_warns_when_validation_is_disabled(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=1, limit_val_batches=0,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         logger=False, callbacks=[JacobianMonitor()])
    with pytest.warns(UserWarning, match="validation is disabled"):
        trainer.fit(TinyModule(), DataLoader(_data(), batch_size=4))


@pytest.mark.parametrize("module", ["jvpreg.callbacks.monitor", "jvpreg.analysis._jacobian",
                                    "jvpreg.analysis.spectral", "jvpreg.analysis.estimators",
                                    "jvpreg.analysis.affine", "jvpreg.analysis.linop", "jvpreg.bench.spectral"])
def test_no_module_level_wandb_or_hydra_imports(module):
    """Importable without wandb/hydra: neither is imported at module level (checked on the source)."""
    import ast
    import importlib.util

    tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in ("wandb", "hydra", "omegaconf", "scipy", "matplotlib")]
