"""Tests for jvpreg.robustness (attacks, noise, transforms, ||J||_F) and the ``jvpreg-eval`` entry."""
from __future__ import annotations

import json
import os

import pytest
import torch
from hydra import compose, initialize_config_module
from torch import nn

from jvpreg.evaluate import evaluate, load_checkpoint
from jvpreg.models import build_model
from jvpreg.robustness import (accuracy, adversarial_accuracy, evaluate_robustness, fgsm, format_table,
                               jacobian_frobenius, noise_accuracy, pgd, transform_images)


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return build_model("small_cnn", in_channels=1, num_classes=10, image_size=8).train()


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.rand(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)) for _ in range(2)]


def per_sample_jacobian(model, x):
    return torch.func.vmap(torch.func.jacrev(lambda z: model(z[None])[0]))(x).detach()


@pytest.mark.slow
def test_exact_jacobian_norm_matches_torch_func(model, batches):
    res = jacobian_frobenius(model, batches, method="exact", max_rows=100)  # forces tangent chunking
    assert model.training  # mode restored
    model.eval()
    x = torch.cat([b[0] for b in batches])
    norms = per_sample_jacobian(model, x).flatten(1).norm(dim=1)
    assert res["jacobian_fro_exact"] == 1.0
    assert res["jacobian_fro"] == pytest.approx(float(norms.mean()), rel=1e-4)
    assert res["jacobian_fro_sq"] == pytest.approx(float(norms.pow(2).mean()), rel=1e-4)


@pytest.mark.slow
def test_hutchinson_jacobian_norm_is_close(model, batches):
    exact = jacobian_frobenius(model, batches, method="exact")["jacobian_fro_sq"]
    est = jacobian_frobenius(model, batches, method="hutchinson", n_projections=512)
    assert est["jacobian_fro_exact"] == 0.0
    assert est["jacobian_fro_sq"] == pytest.approx(exact, rel=0.15)


def test_jacobian_auto_and_max_samples(model, batches):
    assert jacobian_frobenius(model, batches, exact_max_dim=10, n_projections=2)["jacobian_fro_exact"] == 0.0
    one = jacobian_frobenius(model, batches, method="exact", max_samples=1)
    model.eval()
    ref = per_sample_jacobian(model, batches[0][0][:1]).norm()
    assert one["jacobian_fro"] == pytest.approx(float(ref), rel=1e-4)
    with pytest.raises(ValueError, match=r"expected method 'auto', 'exact' or 'hutchinson', got 'svd'"):
        jacobian_frobenius(model, batches, method="svd")


def test_fgsm_and_pgd_stay_in_the_ball_and_hurt(model, batches):
    model.eval()
    x, y = batches[0]
    for adv in (fgsm(model, x, y, 0.1), pgd(model, x, y, 0.1, steps=5)):
        assert (adv - x).abs().max() <= 0.1 + 1e-6
        assert adv.min() >= 0 and adv.max() <= 1
        loss = nn.functional.cross_entropy
        assert loss(model(adv), y) > loss(model(x), y)
    assert torch.equal(fgsm(model, x, y, 0.0), x)


def test_accuracies(model, batches):
    clean = accuracy(model, batches)
    assert 0 <= clean <= 1
    assert noise_accuracy(model, batches, 0.0) == clean
    assert adversarial_accuracy(model, batches, 0.0, attack="fgsm") == clean
    assert adversarial_accuracy(model, batches, 0.3, attack="pgd", steps=3) <= clean
    with pytest.raises(ValueError, match="expected attack 'fgsm' or 'pgd'"):
        adversarial_accuracy(model, batches, 0.1, attack="cw")
    with pytest.raises(ValueError, match="expected sigma >= 0"):
        noise_accuracy(model, batches, -1.0)


def test_transform_images():
    img = torch.zeros(1, 1, 8, 8)
    img[0, 0, 2, 5] = 1.0
    assert transform_images(img, translate=(1, 0))[0, 0].nonzero().tolist() == [[2, 6]]
    assert transform_images(img, translate=(0, 1))[0, 0].nonzero().tolist() == [[3, 5]]
    assert torch.allclose(transform_images(img), img, atol=1e-6)
    sq = torch.zeros(1, 1, 9, 9)
    sq[0, 0, 4, 8] = 1.0  # right of the center -> below it after +90 degrees
    rotated = transform_images(sq, angle=90)[0, 0]
    assert rotated.argmax().item() // 9 == 8 and rotated.argmax().item() % 9 == 4


@pytest.mark.slow
def test_evaluate_robustness_keys_and_table(model, batches):
    m = evaluate_robustness(model, batches, noise_sigmas=[0.1], fgsm_eps=[0.05], pgd_eps=[0.05], pgd_steps=2,
                            rotations=[10], translations=[1], jacobian="exact")
    assert set(m) == {"n_samples", "clean_acc", "noise_acc@0.1", "fgsm_acc@0.05", "pgd_acc@0.05", "rot_acc@10",
                      "shift_acc@1", "jacobian_fro", "jacobian_fro_sq", "jacobian_fro_exact"}
    assert m["n_samples"] == 12
    table = format_table(m)
    assert table.startswith("| metric | value |") and "| clean_acc |" in table


# ---------------------------------------------------------------- jvpreg-eval


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from jvpreg.train import train

    tmp = str(tmp_path_factory.mktemp("run"))
    with initialize_config_module("jvpreg.conf", version_base="1.3"):
        cfg = compose("train", overrides=[
            f"paths.root_dir={tmp}", f"paths.work_dir={tmp}", f"paths.output_dir={tmp}/out", "logger=none",
            "trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.enable_progress_bar=false",
            "robustness.enabled=false", "test=false"])
    os.environ["WANDB_MODE"] = "disabled"
    result, _ = train(cfg)
    return result["paths"]["best_checkpoint"]


def eval_cfg(tmp_path, ckpt, *overrides):
    tmp = str(tmp_path)
    with initialize_config_module("jvpreg.conf", version_base="1.3"):
        return compose("eval", overrides=[f"paths.root_dir={tmp}", f"paths.work_dir={tmp}",
                                          f"paths.output_dir={tmp}", f"ckpt_path={ckpt}",
                                          "robustness.pgd_steps=2", "robustness.max_samples=64", *overrides])


@pytest.mark.slow
def test_load_checkpoint(checkpoint):
    lit, run_config = load_checkpoint(checkpoint)
    assert not lit.training and run_config["model"]["name"] == "small_cnn"
    assert lit.net(torch.rand(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.slow
def test_jvpreg_eval_reports_table_and_json(tmp_path, checkpoint, capsys):
    report = evaluate(eval_cfg(tmp_path, checkpoint))
    out = capsys.readouterr().out
    assert "| clean_acc |" in out and "| fgsm_acc@0.1 |" in out and "| pgd_acc@0.05 |" in out
    assert "| noise_acc@0.3 |" in out and "| jacobian_fro |" in out
    data = json.loads((tmp_path / "robustness.json").read_text())
    assert data["metrics"] == report["metrics"] and data["data_source"] == "checkpoint"
    assert data["metrics"]["jacobian_fro_exact"] == 1.0  # 8x8 digits: exact


def test_jvpreg_eval_overrides(tmp_path, checkpoint):
    report = evaluate(eval_cfg(tmp_path, checkpoint, "split=val", "batch_size=16", "robustness.jacobian=null",
                               "robustness.noise_sigmas=[0.5]", "robustness.fgsm_eps=[]", "robustness.pgd_eps=[]"))
    assert set(report["metrics"]) == {"n_samples", "clean_acc", "noise_acc@0.5"}
    other = evaluate(eval_cfg(tmp_path, checkpoint, "data=synthetic", "robustness.jacobian=null"))
    assert other["data_source"] == "command line" and other["data"] == "jvpreg.data.SyntheticDataModule"


def test_jvpreg_eval_errors(tmp_path, checkpoint):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at ckpt_path='nope.ckpt'"):
        evaluate(eval_cfg(tmp_path, "nope.ckpt"))
    with pytest.raises(ValueError, match=r"expected split=test or split=val, got 'train'"):
        evaluate(eval_cfg(tmp_path, checkpoint, "split=train"))
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ValueError, match=r"has no 'jvpreg_config' entry"):
        evaluate(eval_cfg(tmp_path, str(foreign)))
