"""TorchScript inside a clone forward (:mod:`jvpreg.clone.eager.torchscript`): exact, never rows-as-samples.

TorchScript runs its ops in C++, where ``__torch_function__`` cannot see them: before, a scripted function in a
model gave a JVP 0.49 off and a scripted module one 0.067 off, silently. References: ``torch.func.jvp`` of the
Python originals in float64.
"""
import copy
import warnings

import pytest
import torch
from torch import nn

import jvpreg
from jvpreg.clone import JVPCaptureWarning, JVPFallbackWarning
from jvpreg.clone.program import capture

D = torch.float64
ENGINES = ["eager", "auto", "captured"]


@torch.jit.script
def scripted_gate(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * torch.sigmoid(x) + torch.relu(x)


def python_gate(x):
    return torch.tanh(x) * torch.sigmoid(x) + torch.relu(x)


class Gated(nn.Module):
    def __init__(self, gate):
        super().__init__()
        self.gate, self.a, self.b = gate, nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.b(self.gate(self.a(x)))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).to(D)


def _inputs(shape=(3, 4)):
    torch.manual_seed(1)
    return torch.randn(shape, dtype=D), torch.randn(shape, dtype=D)


def _assert_exact(got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_scripted_function_in_a_model_runs_its_python_original(engine):
    """Through the rules, so the model is still captured (a program recorded, no warning)."""
    torch.manual_seed(0)
    model = Gated(scripted_gate).to(D)
    x, u = _inputs()
    want = torch.func.jvp(_with_gate(model, python_gate), (x,), (u,))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", JVPCaptureWarning)
        for _ in range(3):
            _assert_exact(jvpreg.jvp(model, (x,), (u,), engine=engine)[1], want)
    if engine != "eager":
        assert any(p.gm is not None for p in capture.programs(model).values())


def _with_gate(model, gate):
    other = Gated(gate).to(D)
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["script", "trace"])
def test_a_scripted_or_traced_module_takes_the_exact_fallback(kind, engine):
    """Repeated calls (TorchScript's profiling executor changes its graph after the first runs: its forward AD was
    right on the first call only, which the fallback therefore does not use)."""
    model = _mlp()
    x, u = _inputs()
    script = torch.jit.script(model) if kind == "script" else torch.jit.trace(model, (x,))
    want = torch.func.jvp(model, (x,), (u,))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JVPFallbackWarning)
        warnings.simplefilter("ignore", JVPCaptureWarning)
        for _ in range(4):
            _assert_exact(jvpreg.jvp(script, (x,), (u,), engine=engine)[1], want)


def test_the_fallback_names_torchscript_and_the_cure(monkeypatch):
    from jvpreg.clone.eager import dispatch

    monkeypatch.setattr(dispatch, "WARNED_FALLBACKS", set())  # said once per process: not yet in this test
    model = _mlp()
    x, u = _inputs()
    with pytest.warns(JVPFallbackWarning, match=r"TorchScript.*call the Python original"):
        jvpreg.jvp(torch.jit.script(model), (x,), (u,), engine="eager")


def test_a_scripted_submodule_and_the_gradient_of_a_penalty_through_it():
    """A Python model holding a scripted submodule: JVP and the parameter gradients of ``|J u|^2`` equal those of
    the all-Python model (autograd through the reverse-mode fallback)."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).to(D)
    python = Gated(inner).to(D)
    scripted = copy.deepcopy(python)
    scripted.gate = torch.jit.script(scripted.gate)
    x, u = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JVPFallbackWarning)
        warnings.simplefilter("ignore", JVPCaptureWarning)
        for _ in range(2):
            _, got = jvpreg.jvp(scripted, (x,), (u,))
            grads = torch.autograd.grad(got.pow(2).sum(), list(scripted.parameters()))
    _, want = jvpreg.jvp(python, (x,), (u,), engine="eager")
    want_grads = torch.autograd.grad(want.pow(2).sum(), list(python.parameters()))
    _assert_exact(got, torch.func.jvp(python, (x,), (u,))[1])
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
