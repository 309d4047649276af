"""``jvpreg-train`` with timm and Hugging Face models (optional extras): every regularizer trains on tiny
configs (CPU, random weights, no downloads), and the errors users hit first name the fix."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from hydra.errors import InstantiationException

from jvpreg.train import train
from test_train import REGULARIZERS, fdr, make_cfg

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# tiny networks: a 1-stage-per-level ConvNeXt, a 2-block ViT, Hugging Face ViT / ConvNeXt / Swin
TIMM_CONVNEXT = ["model=timm", "model.name=convnext_atto", "data.resize=32", "+model.depths=[1,1,1,1]",
                 "+model.dims=[8,16,32,64]"]
TIMM_VIT = ["model=timm", "model.name=vit_tiny_patch16_224", "+model.patch_size=2", "+model.depth=2",
            "+model.embed_dim=32", "+model.num_heads=2"]
SOURCES = {"timm_convnext": ("timm", TIMM_CONVNEXT), "timm_vit": ("timm", TIMM_VIT),
           "hf_vit": ("transformers", ["model=hf"]), "hf_convnext": ("transformers", ["model=hf_convnext"]),
           "hf_swin": ("transformers", ["model=hf_swin"])}


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _penalties(result):
    logged = result["history"][0]
    return {k: v for k, v in logged.items() if k.startswith("train/") and k not in (
        "train/loss", "train/loss_step", "train/loss_epoch", "train/acc", "train/total_loss") and not k.endswith("_weight")}


@pytest.mark.parametrize("reg", [r if r == "jacobian" else pytest.param(r, marks=pytest.mark.slow)
                                 for r in REGULARIZERS])
@pytest.mark.parametrize("source", ["timm_convnext", pytest.param("hf_vit", marks=pytest.mark.slow)])
def test_every_regularizer_trains_timm_and_hf(tmp_path, source, reg):
    _, overrides = SOURCES[source]
    result, objects = fdr(tmp_path, *overrides, f"regularizer={reg}", "data.batch_size=8")
    n_reg = sum(type(cb).__name__.endswith("Regularizer") for cb in objects["callbacks"])
    assert n_reg == {"none": 0, "stacked": 2}.get(reg, 1)
    pens = _penalties(result)
    assert len(pens) == n_reg and all(torch.isfinite(torch.tensor(v)) for v in pens.values()), pens
    if reg != "none":
        assert "train/total_loss" in result["history"][0]


@pytest.mark.parametrize("source", ["timm_vit", "hf_convnext", "hf_swin"])
def test_more_architectures_train_with_jacobian_regularization(tmp_path, source):
    _, overrides = SOURCES[source]
    result, _ = fdr(tmp_path, *overrides, "regularizer=jacobian", "data.batch_size=8")
    assert len(_penalties(result)) == 1


@pytest.mark.slow
def test_hf_short_run_evaluates_robustness_and_names_the_model(tmp_path):
    result, objects = train(make_cfg(tmp_path, [
        "model=hf", "logger=none", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1", "robustness.max_samples=16", "robustness.jacobian_max_samples=4",
        "robustness.pgd_steps=1", "robustness.noise_sigmas=[0.1]", "robustness.fgsm_eps=[0.1]",
        "robustness.pgd_eps=[0.05]"]))
    assert result["model"] == "hf_vit"
    assert "robustness/jacobian_fro" in result["metrics"] and "test/acc" in result["metrics"]


# ---------------------------------------------------------------- errors


def test_timm_unknown_name_suggests_the_closest(tmp_path):
    with pytest.raises(InstantiationException, match=r"unknown timm model 'convnxt_atto'\. Did you mean "
                                                     r"'convnext_atto'"):
        fdr(tmp_path, "model=timm", "model.name=convnxt_atto", "data.resize=32")


def test_timm_model_too_large_for_the_data_says_resize(tmp_path):
    with pytest.raises(ValueError, match=r"model=convnext_atto fails on 1x8x8 inputs .*Fix: resize the data, "
                                         r"e\.g\. data\.resize=32"):
        fdr(tmp_path, "model=timm", "+model.depths=[1,1,1,1]", "+model.dims=[8,16,32,64]")


def test_hf_misspelt_config_field(tmp_path):
    with pytest.raises(InstantiationException, match=r"ViTConfig has no field 'hiden_size'\. Did you mean "
                                                     r"'hidden_size'\?"):
        fdr(tmp_path, "model=hf", "+model.config.hiden_size=8")


@pytest.mark.parametrize("option, package, extra", [("timm", "timm", "timm"), ("hf", "transformers", "hf")])
def test_missing_extra_names_the_install_command(tmp_path, monkeypatch, option, package, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ImportError, match=rf"model=\S+ needs the optional package '{package}', which is not "
                                          rf"installed\. Fix: pip install -e \"\.\[{extra}\]\""):
        fdr(tmp_path, f"model={option}")


def test_timm_pretrained_download_failure_says_what_to_do(monkeypatch):
    import timm
    from jvpreg.models import build_timm

    def offline(name, pretrained=False, **kwargs):
        if pretrained:
            raise OSError("We couldn't connect to 'https://huggingface.co'")
        return real(name, pretrained=pretrained, **kwargs)

    real = timm.create_model
    monkeypatch.setattr(timm, "create_model", offline)
    with pytest.raises(RuntimeError, match=r"build_timm\('resnet10t', pretrained=True\): could not load the pretrained "
                                           r"weights \(OSError: .*run online once .* or use model\.pretrained=false"):
        build_timm("resnet10t", in_channels=3, num_classes=5, image_size=32, pretrained=True)


def test_hf_pretrained_loads_the_checkpoint_sized_to_the_data(monkeypatch):
    import transformers
    from jvpreg.models import HFImageClassifier, build_hf

    seen = {}

    def from_pretrained(name, **kwargs):
        seen.update(kwargs, name=name)
        return build_hf("vit", in_channels=3, num_classes=4, image_size=8, config={
            "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 8,
            "patch_size": 4}).model

    monkeypatch.setattr(transformers.AutoModelForImageClassification, "from_pretrained", from_pretrained)
    net = build_hf("vit", in_channels=3, num_classes=4, image_size=8, pretrained="google/vit-base-patch16-224")
    assert isinstance(net, HFImageClassifier) and net(torch.randn(2, 3, 8, 8)).shape == (2, 4)
    assert seen == {"name": "google/vit-base-patch16-224", "ignore_mismatched_sizes": True, "num_channels": 3,
                    "num_labels": 4, "image_size": 8}
