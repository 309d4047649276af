"""Every option of every Hydra config group composes (``hydra.compose``) and builds what it names."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import MissingConfigException
from hydra.utils import instantiate
from omegaconf import OmegaConf

import jvpreg.conf
from jvpreg.models import list_models

CONF = Path(jvpreg.conf.__file__).parent
GROUPS = ("model", "data", "regularizer", "trainer", "logger", "callbacks", "experiment", "hparams_search",
          "launcher", "paths", "debug", "hydra")
PLUGIN_OPTIONS = {("hparams_search", "digits_optuna"): "hydra_plugins.hydra_optuna_sweeper",
                  ("launcher", "slurm"): "hydra_plugins.hydra_submitit_launcher"}


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def make_cfg(overrides=(), tmp="/tmp/jvpreg-test", config_name="train"):
    with initialize_config_module("jvpreg.conf", version_base="1.3"):
        return compose(config_name, overrides=[f"paths.root_dir={tmp}", f"paths.work_dir={tmp}",
                                             f"paths.output_dir={tmp}/out", *overrides])


def _has(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_every_group_exists_and_is_packaged():
    for group in GROUPS:
        assert options(group), f"config group {group}/ is empty"
    assert (CONF / "train.yaml").is_file() and (CONF / "eval.yaml").is_file()
    # the console scripts find the configs through the package, from any folder
    assert importlib.util.find_spec("jvpreg.conf") is not None


def test_default_config():
    cfg = make_cfg()
    assert cfg.data._target_ == "jvpreg.data.DigitsDataModule"
    assert cfg.model.name == "small_cnn"
    assert list(cfg.regularizer.callbacks) == ["jacobian"]
    assert cfg.trainer.accelerator == "cpu"
    assert sorted(cfg.logger) == ["csv", "wandb"]
    assert (cfg.model.in_channels, cfg.model.num_classes, cfg.model.image_size) == (1, 10, 8)
    assert cfg.regularizer.callbacks.jacobian.weight == cfg.regularizer.weight


QUICK_MODELS = ("mlp", "small_cnn")  # the quick tier's model options; the others (0.3 s a compose) in the sweep tier


@pytest.mark.parametrize("group, option", [
    pytest.param(g, o, marks=pytest.mark.sweep if g == "model" and o not in QUICK_MODELS else ())
    for g in GROUPS if g not in ("paths", "hydra") for o in options(g)])
def test_every_option_composes_and_resolves(group, option):
    overrides = [f"{group}={option}"]
    if group == "model" and option in ("vgg11", "vgg11_bn", "vgg16", "vgg19", "densenet121", "densenet169",
                                       "densenet201", "inception_v3", "lenet5"):
        overrides.append("data.resize=75" if option == "inception_v3" else "data.resize=32")
    if (group, option) in PLUGIN_OPTIONS and not _has(PLUGIN_OPTIONS[(group, option)]):
        with pytest.raises(MissingConfigException, match=r"hydra/(sweeper/optuna|launcher/submitit_slurm)"):
            make_cfg(overrides)
        return
    cfg = make_cfg(overrides)
    OmegaConf.resolve(cfg)  # every interpolation resolves
    assert cfg.model.image_size == cfg.data.image_size


EXTERNAL_MODELS = {"timm": "build_timm", "hf": "build_hf", "hf_convnext": "build_hf", "hf_swin": "build_hf"}


@pytest.mark.parametrize("name", [pytest.param(o, marks=() if o in QUICK_MODELS else pytest.mark.sweep)
                                  for o in options("model") if o not in EXTERNAL_MODELS])
def test_model_configs_name_registered_architectures(name):
    cfg = make_cfg([f"model={name}"])
    assert cfg.model.name == name and name in list_models()
    assert cfg.model._target_ == "jvpreg.models.build_model"


@pytest.mark.parametrize("name", list(EXTERNAL_MODELS))
def test_external_model_configs_build_from_the_data(name):
    extra = ["data.resize=32", "+model.depths=[1,1,1,1]", "+model.dims=[8,16,32,64]"] if name == "timm" else []
    cfg = make_cfg([f"model={name}", *extra])
    assert cfg.model._target_ == f"jvpreg.models.{EXTERNAL_MODELS[name]}"
    net = instantiate(cfg.model)
    side = cfg.data.image_size
    assert net(torch.rand(2, 1, side, side)).shape == (2, 10)


def test_every_registered_model_has_a_config():
    assert set(list_models()) <= set(options("model"))


@pytest.mark.parametrize("name", ["mlp", "small_cnn", "lenet5", "rnn", "unet"])
def test_small_model_configs_instantiate_for_the_data(name):
    cfg = make_cfg([f"model={name}"] + (["data.resize=16"] if name == "lenet5" else []))
    net = instantiate(cfg.model)
    out = net(torch.rand(2, 1, *([16, 16] if name == "lenet5" else [8, 8])))
    assert out.shape == (2, 10)


@pytest.mark.parametrize("option", options("data"))
def test_data_configs_instantiate(option):
    # torchvision datasets: download=true only so that construction does not require the files
    cfg = make_cfg([f"data={option}"] + (["data.download=true"] if option in ("mnist", "fashion_mnist", "cifar10")
                                         else []))
    dm = instantiate(cfg.data)
    assert tuple(dm.input_shape) == (cfg.data.in_channels, *([cfg.data.image_size] * 2))
    assert dm.num_classes == cfg.data.num_classes


def test_data_resize_flows_into_the_model():
    cfg = make_cfg(["data.resize=32", "model=vgg11"])
    assert cfg.model.image_size == 32 and cfg.data.image_size == 32


def test_synthetic_shape_overrides():
    cfg = make_cfg(["data=synthetic", "data.in_channels=3", "data.size=32", "data.num_classes=4"])
    assert (cfg.model.in_channels, cfg.model.image_size, cfg.model.num_classes) == (3, 32, 4)
    assert instantiate(cfg.data).input_shape == (3, 32, 32)


@pytest.mark.parametrize("option", options("regularizer"))
def test_regularizer_configs_build_their_callbacks(option):
    from jvpreg.train import build_callbacks

    cfg = make_cfg([f"regularizer={option}", "callbacks=none", "regularizer.weight=0.5"])
    callbacks = build_callbacks(cfg)
    assert len(callbacks) == len(cfg.regularizer.callbacks)
    for cb in callbacks:
        assert type(cb).__module__.startswith("jvpreg.callbacks")


def test_zero_weight_regularizer_is_skipped():
    from jvpreg.train import build_callbacks

    assert build_callbacks(make_cfg(["regularizer.weight=0", "callbacks=none"])) == []


@pytest.mark.parametrize("option", options("callbacks"))
def test_callback_configs_instantiate(option):
    from jvpreg.train import build_callbacks

    cfg = make_cfg([f"callbacks={option}", "regularizer=none"])
    callbacks = build_callbacks(cfg)
    assert len(callbacks) == len(cfg.callbacks or {})


@pytest.mark.parametrize("option", options("logger"))
def test_logger_configs(option, tmp_path):
    from jvpreg.train import build_loggers

    cfg = make_cfg([f"logger={option}"], tmp=str(tmp_path))
    needs_tb = "tensorboard" in (cfg.logger or {})
    if needs_tb and not (_has("tensorboard") or _has("tensorboardX")):
        with pytest.raises(ImportError, match=r"pip install tensorboard"):
            build_loggers(cfg)
        return
    loggers = build_loggers(cfg)
    assert len(loggers) == len(cfg.logger or {})


def test_wandb_logger_is_offline_by_default(monkeypatch):
    from jvpreg.train import _setdefault_wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    _setdefault_wandb_mode()
    assert os.environ["WANDB_MODE"] == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")
    _setdefault_wandb_mode()
    assert os.environ["WANDB_MODE"] == "online"  # the user's choice wins


@pytest.mark.parametrize("option", options("trainer"))
def test_trainer_configs(option):
    cfg = make_cfg([f"trainer={option}", "trainer.enable_progress_bar=false"])
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        with pytest.raises(Exception, match=r"(?i)gpu|cuda"):
            instantiate(cfg.trainer, logger=False)
        return
    trainer = instantiate(cfg.trainer, logger=False)
    assert trainer.num_devices == cfg.trainer.devices


def test_ddp_sim_is_cpu_gloo_spawn():
    cfg = make_cfg(["trainer=ddp_sim"])
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 2
    assert cfg.trainer.strategy.process_group_backend == "gloo" and cfg.trainer.strategy.start_method == "spawn"


def test_experiments_pin_their_setting():
    cfg = make_cfg(["experiment=digits_jacobian"])
    assert cfg.task_name == "digits_jacobian" and cfg.model.name == "small_cnn"
    assert "jacobian" in cfg.regularizer.callbacks
    cfg = make_cfg(["experiment=digits_tangent_prop"])
    assert "tangent_prop" in cfg.regularizer.callbacks and list(cfg.robustness.rotations)


def test_plugin_configs_document_their_install():
    assert "pip install hydra-optuna-sweeper" in (CONF / "hparams_search" / "digits_optuna.yaml").read_text()
    assert "pip install hydra-submitit-launcher" in (CONF / "launcher" / "slurm.yaml").read_text()


def test_missing_plugin_error_names_the_package(monkeypatch):
    from jvpreg import train

    monkeypatch.setitem(train.PLUGINS, "hparams_search=", ("hydra_plugins.no_such_plugin_xyz", "hydra-optuna-sweeper"))
    with pytest.raises(SystemExit, match=r"pip install hydra-optuna-sweeper"):
        train.check_plugins(["-m", "hparams_search=digits_optuna"])
    train.check_plugins(["hparams_search=null", "model=mlp"])  # nothing needed


def test_eval_config_composes():
    cfg = make_cfg(["ckpt_path=x.ckpt"], config_name="eval")
    assert cfg.ckpt_path == "x.ckpt" and cfg.get("data") is None
    cfg = make_cfg(["ckpt_path=x.ckpt", "data=synthetic"], config_name="eval")
    assert cfg.data._target_ == "jvpreg.data.SyntheticDataModule"


def test_unknown_group_option_lists_the_choices():
    with pytest.raises(MissingConfigException, match=r"Could not find 'model/no_such_net'[\s\S]*resnet18"):
        make_cfg(["model=no_such_net"])
    with pytest.raises(MissingConfigException, match=r"Could not find 'regularizer/foo'"):
        make_cfg(["regularizer=foo"])


@pytest.mark.slow
def test_hydra_is_imported_only_by_the_entry_points():
    """``import jvpreg`` (and its subpackages) must not import Hydra: only train/evaluate/conf do (and
    ``generative/run.py``, which only ``train.py`` imports, when a config has a ``generative`` node, and
    ``app_setup.py``, the setup both runs share)."""
    import ast

    root = CONF.parent
    allowed = {root / "train.py", root / "evaluate.py", root / "generative" / "run.py",  # run.py: train.py's
               root / "app_setup.py"}
    offenders = []
    for path in root.rglob("*.py"):
        if path in allowed or CONF in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "hydra" or n.startswith("hydra.") for n in names):
                offenders.append(str(path.relative_to(root)))
    assert not offenders, f"modules importing hydra: {offenders}"
