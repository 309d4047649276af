"""No host synchronisation in a JVP or a regularized step on an accelerator.

On a GPU, a read of a tensor's value by Python (``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``) waits for
every kernel queued before it, so the host stops running ahead of the device; one such read per step costs a
small-kernel model most of its speed. The ``meta`` device has shapes and no values: every value read raises there.
The engine reads values on the CPU only, where a read costs nothing, and takes the same code paths on ``meta`` as on
a GPU, so a step that runs on ``meta`` tensors is a step that reads no value on a GPU. Each case runs three steps:
the eager clone forward, the capture (engine ``"auto"`` captures on the second call) and a replay.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jvpreg
from jvpreg.bench.capture import SUITES, vit_small
from jvpreg.callbacks.regularizer import JacobianRegularizer
from jvpreg.callbacks.shared import SharedForward
from jvpreg.clone.program import capture
from jvpreg.losses import (JacobianFrobenius, JacobianSpectralNorm, JVPConstraint, ParameterSensitivity, Stack,
                           TangentProp, regularized_forward)

META = torch.device("meta")
FAST = ("mlp",)  # the quick tier; every other model in the sweep tier (--slow)


def _cnn_bn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 10))


IMAGE_MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 32), nn.ReLU(), nn.Linear(32, 10)),
            (4, 3, 16, 16)),
    "cnn_bn": (_cnn_bn, (4, 3, 16, 16)),
    "resnet18": (SUITES["small"]["resnet18"][0], (2, 3, 32, 32)),
    "vit": (vit_small, (2, 3, 32, 32)),
}
SEQUENCE_MODELS = {name: SUITES["rnn"][name] for name in ("lstm2", "gru2", "lstm2_packed")}
MODELS = {**IMAGE_MODELS, **SEQUENCE_MODELS, "row_rnn": SUITES["rnn"]["row_rnn"]}

PENALTIES = {
    "frobenius": lambda: JacobianFrobenius(),
    "frobenius_2_rademacher_hoffman": lambda: JacobianFrobenius(2, "rademacher", "hoffman"),
    "spectral": lambda: JacobianSpectralNorm(),
    "lipschitz": lambda: JVPConstraint(lambda x, y: torch.randn_like(x), kind="lipschitz", lipschitz=1.0),
    "tangent_prop": lambda: TangentProp(),
    "sensitivity": lambda: ParameterSensitivity(params=("*weight",)),
    "stack": lambda: Stack([JacobianFrobenius(), ParameterSensitivity(params=("*weight",))], weights=[1.0, 0.5]),
}


def _models(names):
    return [pytest.param(n, marks=() if n in FAST else pytest.mark.sweep) for n in sorted(names)]


def _on_meta(name):
    torch.manual_seed(0)
    build, shape = MODELS[name]
    return build().to(META).train(), torch.randn(shape, device=META)


def _captured(model) -> bool:
    progs = capture.programs(model).values()
    return bool(progs) and all(p.gm is not None for p in progs)


def test_meta_reads_raise():
    """The premise: on ``meta``, each way Python reads a value raises."""
    t = torch.ones(2, device=META)
    for read in (lambda: t.sum().item(), lambda: bool(t.any()), lambda: float(t[0]), lambda: t.tolist()):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


@pytest.mark.parametrize("engine", ["eager", pytest.param("auto", marks=pytest.mark.sweep)])
@pytest.mark.parametrize("penalty", sorted(PENALTIES))
@pytest.mark.parametrize("name", _models(MODELS))
def test_regularized_step_reads_no_value(name, penalty, engine):
    if penalty == "tangent_prop" and name not in IMAGE_MODELS:
        pytest.skip("TangentProp transforms images")
    model, x = _on_meta(name)
    pen = PENALTIES[penalty]().to(META)
    y = torch.randint(0, 10, (x.shape[0],), device=META)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        out, value = regularized_forward(model, x, pen, target=y, engine=engine)
        (F.cross_entropy(out, y) + 0.1 * value).backward()
        opt.step()
    assert value.shape == () and out.shape == (x.shape[0], 10)
    if engine == "auto":
        assert _captured(model), "the third step should replay a captured program"


@pytest.mark.parametrize("name", _models(["cnn_bn", "vit", "lstm2"]))
def test_shared_forward_step_reads_no_value(name):
    """The callbacks' path: the model's own call runs the clone forward from hooks, half the batch regularized."""
    model, x = _on_meta(name)
    shared = SharedForward(model)
    y = torch.randint(0, 10, (x.shape[0],), device=META)
    for _ in range(3):
        shared.arm([(JacobianFrobenius(), 0.1, 0.5)])
        try:
            loss = F.cross_entropy(model(x), y) + shared.total()
        finally:
            shared.disarm()
        loss.backward()
    assert _captured(model)


@pytest.mark.parametrize("engine", ["eager", "auto"])
@pytest.mark.parametrize("name", _models(MODELS))
def test_jvp_reads_no_value(name, engine):
    model, x = _on_meta(name)
    model.eval()
    for _ in range(3):
        out, t = jvpreg.jvp(model, (x,), (torch.randn_like(x),), engine=engine)
        outs, ts = jvpreg.jvp(model, (x,), (torch.randn(3, *x.shape, device=META),), batched_tangents=True,
                              engine=engine)
        _, tp = jvpreg.jvp_params(model, (x,), {n: torch.randn_like(p) for n, p in model.named_parameters()},
                                  engine=engine)
    assert t.shape == out.shape and ts.shape == (3, *out.shape) and tp.shape == out.shape
    if engine == "auto":
        assert _captured(model)


def test_regularizer_keeps_its_value_on_the_device():
    """The callback logs the penalty as a tensor and reads it as a number only when asked (``last_value``)."""
    logged = {}

    class Module:
        def log(self, name, value, **kwargs):
            logged[name] = value

    cb = JacobianRegularizer(weight=0.1)
    value = torch.tensor(2.5, device=META)
    cb._record(Module(), value, 0.1, 4)  # would raise on a value read
    assert logged[f"train/{cb.log_name}"].device == META and cb.steps_applied == 1
    cb._record(Module(), torch.tensor(2.5), 0.1, 4)
    assert cb.last_value == 2.5
    state = cb.state_dict()
    fresh = JacobianRegularizer(weight=0.1)
    assert fresh.last_value is None
    fresh.load_state_dict(state)
    assert fresh.last_value == 2.5 and fresh.steps_applied == 2
