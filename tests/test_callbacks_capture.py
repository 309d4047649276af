"""Regularizer callbacks on the captured engine: same gradients as eager clone mode through a real Trainer,
also when the network is torch.compile-d."""
from __future__ import annotations

import copy
import os

os.environ.setdefault("WANDB_MODE", "disabled")

import pytest
import torch

from jvpreg.callbacks import JacobianRegularizer, TangentPropRegularizer
from jvpreg.clone.program import capture

from test_callbacks import GradCapture, Lit, cnn_bn, make_trainer

F64 = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _loader(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 4, 4, generator=g, dtype=F64)
    y = torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _fit(net, engine, compiled=None, steps=2):
    torch.manual_seed(0)
    if compiled == "in-place":
        net.compile(backend="eager")
    lit = Lit(torch.compile(net, backend="eager") if compiled == "wrapped" else net).to(F64)
    grads = GradCapture()
    regs = [JacobianRegularizer(weight=0.5, n_projections=2, seed=0, engine=engine),
            TangentPropRegularizer(weight=0.1, transforms=("translate_x",), engine=engine)]
    make_trainer([*regs, grads], max_steps=steps).fit(lit, _loader())
    return lit, grads.grads


@pytest.mark.parametrize("compiled", [None, pytest.param("wrapped", marks=pytest.mark.slow), "in-place"],
                         ids=["plain-net", "compiled-net", "net-compiled-in-place"])
def test_captured_callbacks_give_the_eager_gradients(compiled):
    """torch.compile(net) and net.compile(): the callbacks clone the original code (the compiled engine by default)."""
    torch.manual_seed(0)
    net = cnn_bn().to(F64)
    lit, grads = _fit(copy.deepcopy(net), "auto", compiled=compiled)
    _, grads_e = _fit(copy.deepcopy(net), "eager")
    assert len(grads) == len(grads_e) == 2
    for step, (g, g_e) in enumerate(zip(grads, grads_e)):
        for name, value in g_e.items():
            key = name.replace("net.", "net._orig_mod.") if compiled == "wrapped" else name
            torch.testing.assert_close(g[key], value, rtol=1e-10, atol=1e-12, msg=lambda m: f"step {step} {name}: {m}")
    progs = capture.programs(lit)
    assert progs and all(p.gm is not None for p in progs.values())
    # one program per step: the packing [x; x + s u] and the unpacking inside it (jvpreg.clone.api.packed_call)
    calls = [k[0][0] if k[0][-1] == "compiled" else k[0] for k in progs]
    assert all(c[0] == "packed" for c in calls), calls
    if compiled == "in-place":
        assert capture.compiled_in_place(lit.net)  # restored after every armed call


def test_regularizers_must_agree_on_the_engine():
    lit = Lit(cnn_bn().to(F64)).to(F64)
    regs = [JacobianRegularizer(weight=0.5, engine="eager"), TangentPropRegularizer(weight=0.1)]
    with pytest.raises(ValueError, match="must agree on the engine"):
        make_trainer(regs, max_steps=1).fit(lit, _loader())


def test_engine_is_validated_at_construction():
    with pytest.raises(ValueError, match="engine"):
        JacobianRegularizer(weight=0.5, engine="turbo")


class _EpochScheduled(Lit):
    """A forward that reads the Trainer's state (a schedule by epoch), as curriculum models do."""

    def forward(self, x):
        return self.net(x) * (10.0 if self.current_epoch >= 1 else 1.0)


@pytest.mark.slow
def test_a_forward_that_reads_the_epoch_recaptures_when_it_changes():
    """``current_epoch`` is ``trainer.fit_loop.epoch_progress.current.completed``: before, only the trainer object
    was re-checked, and the program captured in epoch 0 kept scaling by 1 in epoch 1 (penalty gradients 100x off,
    silently)."""
    torch.manual_seed(0)
    net = cnn_bn().to(F64)
    runs = {}
    for engine in ("auto", "eager"):
        torch.manual_seed(0)
        lit = _EpochScheduled(copy.deepcopy(net)).to(F64)
        grads = GradCapture()
        make_trainer([JacobianRegularizer(weight=0.5, seed=0, engine=engine), grads], max_steps=4).fit(lit, _loader())
        runs[engine] = (lit, grads.grads)
    (lit, grads), (_, grads_e) = runs["auto"], runs["eager"]
    assert len(grads) == len(grads_e) == 4  # two steps in each of two epochs
    for step, (g, g_e) in enumerate(zip(grads, grads_e)):
        for name, value in g_e.items():
            torch.testing.assert_close(g[name], value, rtol=1e-10, atol=1e-12, msg=lambda m: f"step {step} {name}: {m}")
    (prog,) = capture.programs(lit).values()
    assert prog.gm is not None
    assert "_trainer.fit_loop.epoch_progress.current.completed" in {label for *_, label in prog.guards.attributes}
