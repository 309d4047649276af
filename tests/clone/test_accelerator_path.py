"""The accelerator's code path in float64: on the CPU taking it (:func:`jvpreg.clone.core.device_paths.accelerator_path`),
and on a GPU where there is one (``scripts/gpu_benchmarks.sh`` runs this file there).

On a GPU the engine reads no value on the host: the scales are kernels inside the program, the non-finite fixes stay
where an infinity can reach, train-mode BatchNorm takes the device's kernel for its primal block and the backward of
its tangent the form with fewer kernels. These tests hold that path to the references the host's path is held to:
JVPs against forward-mode AD on the CPU, and the gradients of a regularized step against the host path's.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from typing import Callable, ContextManager
from unittest import mock

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvpreg
from jvpreg.clone.program import capture
from jvpreg.clone.rules import batch_norm
from jvpreg.clone.core.device_paths import accelerator_path, on_host
from jvpreg.losses import JacobianFrobenius, ParameterSensitivity, Stack, regularized_forward

D = torch.float64


class LastStep(nn.Module):
    """A 2-layer LSTM's last output: the recurrent rules (sigmoid and tanh gates)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(5, 7, num_layers=2, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0][:, -1]


def _cnn():
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Hardswish(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4))


def _norms():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.GELU(), nn.Flatten(2), nn.LayerNorm(36),
                         nn.SiLU(), nn.Flatten(), nn.Linear(8 * 36, 3))


SETTINGS = [
    dict(name="mlp", build=lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                                                 nn.Linear(16, 3)), shape=(4, 6)),
    dict(name="cnn-batchnorm", build=_cnn, shape=(3, 3, 8, 8)),
    dict(name="group-layer-norm", build=_norms, shape=(2, 3, 8, 8)),
    dict(name="mobilenet_v3_small", build=lambda: torchvision.models.mobilenet_v3_small(num_classes=4),
         shape=(3, 3, 32, 32)),
    dict(name="vit", build=lambda: torchvision.models.VisionTransformer(32, 8, 2, 2, 16, 32, num_classes=4),
         shape=(2, 3, 32, 32)),
    dict(name="lstm", build=LastStep, shape=(3, 4, 5)),
]


def _model(setting, mode):
    torch.manual_seed(0)
    model = setting["build"]().to(D)
    for mod in model.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    with torch.no_grad():  # torchvision's ViT head starts at zero: its JVP would be zero
        for p in model.parameters():
            if not p.any():
                p.normal_()
    return getattr(model, mode)()


def _forward_ad(model, x, u):
    """Forward-mode AD on a copy (train-mode BatchNorm updates the copy's statistics), attention on its math path,
    and ``hardsigmoid`` as ``relu6(x + 3) / 6``: torch's backward kernel for it uses a float32 1/6 (in MobileNetV3's
    train mode a 1e-8 relative error in float64)."""
    exact = lambda h, inplace=False: F.relu6(h + 3) / 6  # noqa: E731
    with fwAD.dual_level(), sdpa_kernel(SDPBackend.MATH), mock.patch.object(F, "hardsigmoid", exact):
        return fwAD.unpack_dual(copy.deepcopy(model)(fwAD.make_dual(x, u))).tangent


def test_cpu_tensors_take_the_accelerator_path_only_inside_it():
    t = torch.zeros(1)
    assert on_host(t) and not on_host(t.to("meta"))
    with accelerator_path():
        assert not on_host(t) and batch_norm.few_launches(t)
    assert on_host(t) and not batch_norm.few_launches(t)


@dataclasses.dataclass
class Path:
    """Where the accelerator's path runs: ``device``, inside ``taken()``."""

    device: str
    taken: Callable[[], ContextManager]


@pytest.fixture(params=["cpu", "cuda"], ids=["cpu-accelerator-path", "cuda"])
def path(request) -> Path:
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no GPU here: the CPU's accelerator path stands in for it")
        return Path("cuda", contextlib.nullcontext)
    return Path("cpu", accelerator_path)


class CpuDraws:
    """A seeded penalty's random directions drawn on the CPU whatever the device (CUDA's generator draws others)."""

    def sample(self, shape, like, distribution="gaussian"):
        return super().sample(shape, like.detach().cpu(), distribution).to(like.device)


class Jacobian(CpuDraws, JacobianFrobenius):
    pass


class Sensitivity(CpuDraws, ParameterSensitivity):
    pass


def _check_jvp(setting, mode, engine, path):
    """Twice (the capture, then a replay), each call from the same running statistics as the reference (forward AD
    on the CPU)."""
    model = _model(setting, mode)
    x = torch.randn(setting["shape"], dtype=D)
    u = torch.randn_like(x)
    state = copy.deepcopy(model.state_dict())
    want = _forward_ad(model, x, u)
    model.to(path.device)
    with path.taken():
        for _ in range(2):
            model.load_state_dict(state)
            _, got = jvpreg.jvp(model, (x.to(path.device),), (u.to(path.device),), engine=engine)
            torch.testing.assert_close(got.cpu(), want, rtol=1e-9, atol=1e-11)
    return model


@pytest.mark.parametrize("engine", ["eager", pytest.param("captured", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("setting", [pytest.param(s, marks=pytest.mark.slow) if s["name"] == "mobilenet_v3_small" else s
                                     for s in SETTINGS], ids=lambda s: s["name"])
def test_jvp_on_the_accelerator_path_matches_forward_ad(setting, mode, engine, path):
    model = _check_jvp(setting, mode, engine, path)
    if engine == "captured":
        programs = [p for p in capture.programs(model).values() if p.gm is not None]
        assert programs and all(p.replays for p in programs)


@pytest.mark.parametrize("engine", ["eager", pytest.param("captured", marks=pytest.mark.slow)])
@pytest.mark.parametrize("setting", [pytest.param(s, marks=pytest.mark.slow) if s["name"] == "mobilenet_v3_small" else s
                                     for s in SETTINGS if s["name"] != "mlp"], ids=lambda s: s["name"])
def test_regularized_step_gradients_on_the_accelerator_path_equal_the_host_paths(setting, engine, path):
    """A train-mode step (task loss, Jacobian and parameter-sensitivity penalties) from the same seed on each path:
    the same gradients and running statistics. BatchNorm's tangent then takes the backward with fewer kernels."""
    results = []
    for device, taken in (("cpu", contextlib.nullcontext), (path.device, path.taken)):
        model = _model(setting, "train").to(device)
        x = torch.randn(setting["shape"], dtype=D, generator=torch.Generator().manual_seed(1)).to(device)
        with taken():
            for _ in range(2):  # the capture, then a replay
                model.zero_grad()
                penalty = Stack([Jacobian(seed=0), Sensitivity(params=("*weight*",), seed=1)])
                out, pen = regularized_forward(model, x, penalty, engine=engine)
                (out.square().mean() + pen).backward()
        results.append(({n: p.grad.cpu() for n, p in model.named_parameters()},
                        {n: v.cpu() for n, v in model.state_dict().items()}))
    (host_grads, host_state), (acc_grads, acc_state) = results
    scale = max(float(g.abs().max()) for g in host_grads.values())
    for name, g in host_grads.items():
        torch.testing.assert_close(acc_grads[name], g, rtol=1e-10, atol=1e-12 * scale, msg=name)
    for name, v in host_state.items():
        torch.testing.assert_close(acc_state[name], v, rtol=1e-12, atol=1e-14, msg=name)


def test_the_host_and_the_accelerator_path_record_programs_of_their_own():
    """A program recorded on one path is not replayed on the other (here with a given scale and inputs the host
    reads as infinite, so that only the scale's finiteness and the path tell the two apart): the host's runs
    train-mode BatchNorm as jvpreg's CPU operator, the accelerator's as the device's kernel and the composite rule."""
    model = _model(SETTINGS[1], "train")
    x, u = torch.randn(3, 3, 8, 8, dtype=D), torch.randn(3, 3, 8, 8, dtype=D)
    x[0, 0, 0, 0] = u[0, 0, 0, 0] = float("inf")
    for path in (contextlib.nullcontext, accelerator_path, contextlib.nullcontext):
        with path(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NaN running statistics
            jvpreg.jvp(model, (x,), (u,), engine="captured", scale=1.0)
    host, acc = capture.programs(model).values()
    assert (host.replays, acc.replays) == (2, 1)

    def targets(prog):
        return {str(n.target) for n in prog.gm.graph.nodes if n.op == "call_function"}

    assert "jvpreg.batch_norm_blocks.default" in targets(host) - targets(acc)


def test_an_infinite_direction_on_the_accelerator_path_replays_the_program_of_finite_ones(path):
    """The host reads whether an input holds an infinity; the accelerator's program, recorded from finite inputs,
    must already allow for one (the same program replays, with the host's eager engine's numbers)."""
    model = _model(SETTINGS[1], "eval")
    x = torch.randn(3, 3, 8, 8, dtype=D)
    u = torch.randn_like(x)
    dev = copy.deepcopy(model).to(path.device)
    with path.taken():
        jvpreg.jvp(dev, (x.to(path.device),), (u.to(path.device),), engine="captured")
    u[1, 0, 2, 2] = float("inf")
    _, want = jvpreg.jvp(model, (x,), (u,), engine="eager")
    with path.taken():
        _, got = jvpreg.jvp(dev, (x.to(path.device),), (u.to(path.device),), engine="captured")
    got = got.cpu()
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-12, atol=1e-14)
    assert torch.isfinite(got[0]).all() and not torch.isfinite(got[1]).all()
    (prog,) = capture.programs(dev).values()
    assert prog.replays == 2


@pytest.mark.slow
@pytest.mark.parametrize("setting", [s for s in SETTINGS if s["name"] in ("cnn-batchnorm", "vit")],
                         ids=lambda s: s["name"])
def test_compiled_engine_on_the_accelerator_path_matches_forward_ad(setting, path):
    """``engine="compiled"`` there leaves the decomposed rules to Inductor (jvpreg's operators are the CPU's)."""
    torch._dynamo.reset()
    _check_jvp(setting, "train", "compiled", path)
