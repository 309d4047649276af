"""Checkpoints from elsewhere load safely (jvpreg.checkpoints): no code runs from a file a user was sent.

Every hostile file here carries a payload that creates a marker file when code from it runs; each test
asserts the marker is absent after jvpreg refused the file, and a control shows the same file does run
its payload when opened the unsafe way (so the marker check can fail).
"""
from __future__ import annotations

import os
import shlex

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

from jvpreg import checkpoints
from jvpreg.checkpoints import UnsafeCheckpointError, read_checkpoint
from jvpreg.evaluate import evaluate, load_checkpoint
from jvpreg.train import train


class Payload:
    """Unpickling it runs ``touch <marker>`` (what a hostile checkpoint does with ``os.system``)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


class ForeignState:
    """Another program's class: rebuilding it calls ``__setstate__``, which touches the marker."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __setstate__(self, state):
        open(state["marker"], "w").close()


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


TINY = ["logger=none", "model=mlp", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "trainer.enable_progress_bar=false",
        "robustness.max_samples=16", "robustness.jacobian_max_samples=4", "robustness.pgd_steps=1",
        "robustness.plot=false"]


def train_cfg(tmp, *overrides):
    tmp = str(tmp)
    with initialize_config_module("jvpreg.conf", version_base="1.3"):
        return compose("train", overrides=[f"paths.root_dir={tmp}", f"paths.work_dir={tmp}",
                                           f"paths.output_dir={tmp}/out", *TINY, *overrides])


def eval_cfg(tmp, ckpt, *overrides):
    tmp = str(tmp)
    with initialize_config_module("jvpreg.conf", version_base="1.3"):
        return compose("eval", overrides=[f"paths.root_dir={tmp}", f"paths.work_dir={tmp}", f"paths.output_dir={tmp}",
                                          f"ckpt_path={ckpt}", "robustness.pgd_steps=1", "robustness.max_samples=16",
                                          "robustness.jacobian_max_samples=4", *overrides])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real jvpreg-train run (digits, MLP, 1 epoch of 2 batches): its result and best checkpoint."""
    os.environ["WANDB_MODE"] = "disabled"
    result, objects = train(train_cfg(tmp_path_factory.mktemp("run")))
    return result, objects["trainer"].global_step


@pytest.fixture
def ckpt(trained):
    return trained[0]["paths"]["best_checkpoint"]


def real(ckpt):
    return torch.load(ckpt, map_location="cpu", weights_only=True)


def write(path, obj, **kwargs):
    torch.save(obj, path, **kwargs)
    return str(path)


# ---------------------------------------------------------------- round trip


@pytest.mark.slow
def test_round_trip_train_eval_resume(tmp_path, trained, ckpt):
    result, steps = trained
    assert result["metrics"]["test/acc"] >= 0 and "robustness/clean_acc" in result["metrics"]
    report = evaluate(eval_cfg(tmp_path / "eval", ckpt))
    assert report["model"] == "mlp" and report["data_source"] == "checkpoint" and report["model_source"] == "checkpoint"
    resumed, objects = train(train_cfg(tmp_path / "resume", f"ckpt_path={ckpt}", "trainer.max_epochs=2"))
    assert objects["trainer"].global_step == 2 * steps  # continued from the checkpoint's step, one more epoch
    again = evaluate(eval_cfg(tmp_path / "eval2", resumed["paths"]["best_checkpoint"], "robustness.jacobian=null"))
    assert 0.0 <= again["metrics"]["clean_acc"] <= 1.0


def test_jvpreg_checkpoints_need_no_extra_globals(ckpt):
    assert torch.serialization.get_unsafe_globals_in_checkpoint(ckpt) == []
    assert checkpoints.SAFE_GLOBALS == ()
    assert set(read_checkpoint(ckpt, what="test")) >= {"state_dict", "jvpreg_config", "optimizer_states"}


def test_model_on_the_command_line_replaces_the_stored_one(tmp_path, ckpt):
    report = evaluate(eval_cfg(tmp_path, ckpt, "model=mlp", "robustness.jacobian=null"))
    assert report["model_source"] == "command line" and report["model"] == "mlp"


# ---------------------------------------------------------------- pickle payloads


def test_pickle_payload_is_refused_by_eval_train_and_resume(tmp_path, ckpt):
    marker = tmp_path / "ran"
    bad = write(tmp_path / "payload.ckpt", {**real(ckpt), "extra": Payload(marker)})
    with pytest.raises(UnsafeCheckpointError, match=r"jvpreg-eval: refused to open .*payload\.ckpt: it holds the "
                                                     r"globals posix\.system[\s\S]*trust_checkpoint=true"):
        evaluate(eval_cfg(tmp_path, bad))
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system"):
        load_checkpoint(bad)
    with pytest.raises(UnsafeCheckpointError, match=r"jvpreg-train: refused to open .*payload\.ckpt"):
        train(train_cfg(tmp_path / "resume", f"ckpt_path={bad}"))
    with pytest.raises(UnsafeCheckpointError, match=r"jvpreg-train: refused to open"):
        train(train_cfg(tmp_path / "test_only", f"ckpt_path={bad}", "train=false"))
    assert not marker.exists()
    torch.load(bad, weights_only=False)  # control: opened the unsafe way, the payload runs
    assert marker.exists()


def test_lightning_itself_loads_weights_only(tmp_path, ckpt, monkeypatch):
    """Without jvpreg's check of the file, Lightning's own torch.load (weights_only=True) still refuses it."""
    marker = tmp_path / "ran"
    bad = write(tmp_path / "payload.ckpt", {**real(ckpt), "extra": Payload(marker)})
    monkeypatch.setattr(checkpoints, "read_checkpoint", lambda *args, **kwargs: {})
    with pytest.raises(Exception, match=r"Weights only load failed"):
        train(train_cfg(tmp_path / "resume", f"ckpt_path={bad}"))
    assert not marker.exists()


def test_trust_checkpoint_is_the_explicit_opt_in(tmp_path, ckpt):
    marker = tmp_path / "ran"
    bad = write(tmp_path / "payload.ckpt", {**real(ckpt), "extra": Payload(marker)})
    lit, run_config = load_checkpoint(bad, trust=True)  # documented: runs code from the file
    assert marker.exists() and run_config["model"]["name"] == "mlp"


def test_a_file_written_by_another_program_is_refused(tmp_path):
    marker = tmp_path / "ran"
    other = write(tmp_path / "other.ckpt", {"foo": ForeignState(marker)})
    with pytest.raises(UnsafeCheckpointError, match=r"it holds the globals test_checkpoints\.ForeignState"):
        evaluate(eval_cfg(tmp_path, other))
    assert not marker.exists()
    torch.load(other, weights_only=False)  # control
    assert marker.exists()


def test_a_plain_tensor_file_from_another_program_has_no_run_config(tmp_path):
    plain = write(tmp_path / "plain.ckpt", {"foo": torch.ones(3)})
    with pytest.raises(ValueError, match=r"plain\.ckpt has no 'jvpreg_config' entry: it was not written by "
                                         r"jvpreg-train"):
        evaluate(eval_cfg(tmp_path, plain))


def test_a_lightning_checkpoint_without_the_run_config(tmp_path, ckpt):
    marker = tmp_path / "ran"
    state = {k: v for k, v in real(ckpt).items() if k != "jvpreg_config"}
    bare = write(tmp_path / "bare.ckpt", state)
    with pytest.raises(ValueError, match=r"bare\.ckpt has no 'jvpreg_config' entry"):
        evaluate(eval_cfg(tmp_path, bare))
    hostile = write(tmp_path / "hostile.ckpt", {**state, "callbacks": {"X": Payload(marker)}})
    with pytest.raises(UnsafeCheckpointError, match=r"hostile\.ckpt: it holds the globals posix\.system"):
        evaluate(eval_cfg(tmp_path, hostile))
    assert not marker.exists()


# ---------------------------------------------------------------- truncated files


def test_a_truncated_checkpoint_is_a_clear_error(tmp_path, ckpt):
    data = open(ckpt, "rb").read()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"jvpreg-eval: .*cut\.ckpt is not a readable torch checkpoint "
                                         r"\(RuntimeError: .*\): truncated, or not written by torch\.save"):
        evaluate(eval_cfg(tmp_path, cut))
    with pytest.raises(ValueError, match=r"jvpreg-train: .*cut\.ckpt is not a readable torch checkpoint"):
        train(train_cfg(tmp_path / "resume", f"ckpt_path={cut}"))


def test_a_truncated_file_with_a_payload_runs_nothing(tmp_path):
    """Legacy (non-zip) format cut after its pickle: unsafe unpickling runs the payload before it hits the end."""
    marker = tmp_path / "ran"
    full = write(tmp_path / "full.ckpt", {"w": torch.ones(1000), "extra": Payload(marker)},
                 _use_new_zipfile_serialization=False)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(open(full, "rb").read()[:-2000])
    with pytest.raises(UnsafeCheckpointError, match=r"cut\.ckpt: it holds an object torch refuses to unpickle "
                                                    r"\(.*posix\.system"):
        evaluate(eval_cfg(tmp_path, cut))
    assert not marker.exists()
    with pytest.raises(Exception):
        torch.load(str(cut), weights_only=False)  # control: fails on the cut, after running the payload
    assert marker.exists()


# ---------------------------------------------------------------- stored configs


def with_config(tmp_path, ckpt, name, **changes):
    state = real(ckpt)
    state["jvpreg_config"] = {**state["jvpreg_config"], **changes}
    return write(tmp_path / name, state)


def test_stored_config_naming_torch_load_of_a_pickle_file_is_refused(tmp_path, ckpt):
    marker = tmp_path / "ran"
    second = write(tmp_path / "second.pt", Payload(marker))
    evil = {"_target_": "torch.load", "f": second, "weights_only": False}
    bad = with_config(tmp_path, ckpt, "evil_model.ckpt", model=evil)
    with pytest.raises(UnsafeCheckpointError, match=r"the model config stored in .*evil_model\.ckpt names "
                                                    r"model\._target_='torch\.load', which jvpreg does not build "
                                                    r"\(allowed: jvpreg\.models\.build_hf.*\)[\s\S]*model=<config>"):
        evaluate(eval_cfg(tmp_path, bad))
    with pytest.raises(UnsafeCheckpointError, match=r"model\._target_='torch\.load'"):
        load_checkpoint(bad)
    assert not marker.exists()
    report = evaluate(eval_cfg(tmp_path, bad, "model=mlp", "robustness.jacobian=null"))  # the user's model wins
    assert report["model_source"] == "command line" and not marker.exists()
    instantiate(evil)  # control: building the stored config runs the payload
    assert marker.exists()


def test_nested_targets_data_targets_remote_code_and_interpolations_are_refused(tmp_path, ckpt):
    marker = tmp_path / "ran"
    second = write(tmp_path / "second.pt", Payload(marker))
    model = real(ckpt)["jvpreg_config"]["model"]
    nested = {**model, "activation": {"_target_": "torch.load", "f": second, "weights_only": False}}
    with pytest.raises(UnsafeCheckpointError, match=r"names model\.activation\._target_='torch\.load'"):
        evaluate(eval_cfg(tmp_path, with_config(tmp_path, ckpt, "nested.ckpt", model=nested)))
    data = {"_target_": "torch.load", "f": second, "weights_only": False}
    with pytest.raises(UnsafeCheckpointError, match=r"the data config stored in .* names data\._target_='torch\.load'"
                                                    r"[\s\S]*data=<config>"):
        evaluate(eval_cfg(tmp_path, with_config(tmp_path, ckpt, "data.ckpt", data=data)))
    remote = {"_target_": "jvpreg.models.build_hf", "arch": "vit", "pretrained": "someone/repo",
              "config": {"trust_remote_code": True}}
    with pytest.raises(UnsafeCheckpointError, match=r"sets model\.config\.trust_remote_code, which makes the builder "
                                                    r"fetch or run code"):
        evaluate(eval_cfg(tmp_path, with_config(tmp_path, ckpt, "remote.ckpt", model=remote)))
    interp = {**model, "hidden": "${oc.env:HOME}"}
    with pytest.raises(UnsafeCheckpointError, match=r"holds an interpolation '\$\{oc\.env:HOME\}'"):
        evaluate(eval_cfg(tmp_path, with_config(tmp_path, ckpt, "interp.ckpt", model=interp)))
    with pytest.raises(UnsafeCheckpointError, match=r"is not a config with a _target_ \(got str\)"):
        evaluate(eval_cfg(tmp_path, with_config(tmp_path, ckpt, "str.ckpt", model="torch.load")))
    assert not marker.exists()


EXTERNAL = {"timm": ["model=timm", "model.name=vit_tiny_patch16_224", "+model.patch_size=2", "+model.depth=1",
                     "+model.embed_dim=16", "+model.num_heads=2"],
            "transformers": ["model=hf", "model.config.num_hidden_layers=1", "model.config.hidden_size=16",
                             "model.config.intermediate_size=32"]}


@pytest.mark.parametrize("package", sorted(EXTERNAL))
@pytest.mark.slow
def test_timm_and_hugging_face_checkpoints_are_rebuilt_from_their_stored_config(tmp_path, package):
    pytest.importorskip(package)
    result, _ = train(train_cfg(tmp_path / "run", *EXTERNAL[package], "robustness.enabled=false", "test=false"))
    lit, run_config = load_checkpoint(result["paths"]["best_checkpoint"])
    assert run_config["model"]["_target_"] in checkpoints.MODEL_TARGETS
    assert lit.net(torch.rand(2, 1, 8, 8)).shape == (2, 10)


def test_a_mean_flow_run_resumes_weights_only(tmp_path, ckpt):
    """``experiment=digits_meanflow ckpt_path=...`` resumes through the same check (before: ckpt_path was ignored)."""
    from jvpreg.generative.run import train_generative

    marker = tmp_path / "ran"
    bad = write(tmp_path / "payload.ckpt", {**real(ckpt), "extra": Payload(marker)})
    tmp = str(tmp_path)
    with initialize_config_module("jvpreg.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.root_dir={tmp}", f"paths.work_dir={tmp}", f"paths.output_dir={tmp}/o",
                                          "experiment=digits_meanflow", "logger=none", "model.depth=1",
                                          f"ckpt_path={bad}"])
    with pytest.raises(UnsafeCheckpointError, match=r"jvpreg-train: refused to open .*payload\.ckpt"):
        train_generative(cfg)
    assert not marker.exists()
