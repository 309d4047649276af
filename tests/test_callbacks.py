"""Tests for jvpreg.callbacks: gradients against float64 references through a real Trainer, the shared
forward, BatchNorm statistics, precision, accumulation, clipping, resume, errors, and a short training run."""
from __future__ import annotations

import copy
import logging
import math
import os

os.environ.setdefault("WANDB_MODE", "disabled")

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from jvpreg.callbacks import (ConstraintRegularizer, JacobianRegularizer, JVPRegularizer,
                              ParameterSensitivityRegularizer, SpectralRegularizer, TangentPropRegularizer,
                              regularized_forward)
from jvpreg.losses import JacobianFrobenius, PenaltyContext, Stack, TangentProp

from test_losses import ref_jvps, reference_model

F64 = torch.float64
LAM = 0.25
logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# --------------------------------------------------------------------------- fixtures


def cnn_bn():
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 2, 3), nn.Tanh(),
                         nn.Flatten(), nn.Linear(8, 3))


def mlp_dropout(p=0.0):
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.Tanh(), nn.Dropout(p), nn.Linear(12, 3))


class Lit(pl.LightningModule):
    """An ordinary classifier: nothing in it knows about the regularizers."""

    def __init__(self, net: nn.Module, lr: float = 0.1, return_dict: bool = False):
        super().__init__()
        self.net, self.lr, self.return_dict = net, lr, return_dict
        self.seen_outputs = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.seen_outputs.append(out.detach().clone())
        loss = F.cross_entropy(out, y)
        return {"loss": loss} if self.return_dict else loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class GradCapture(pl.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None})


def make_trainer(callbacks=(), max_steps=1, **kw):
    kw = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
          "enable_model_summary": False, "max_steps": max_steps, "num_sanity_val_steps": 0, **kw}
    return pl.Trainer(callbacks=list(callbacks), **kw)


def data(n=8, batch=8, seed=100, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 4, 4, generator=g).to(dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch), x, y


def twin_u(pen, x, k_model=None):
    twin = copy.deepcopy(pen)
    ctx = PenaltyContext(x=x, model=k_model)
    return twin.directions(x, ctx), (twin.param_directions(k_model, ctx) if k_model is not None else None)


def strip(grads):
    return {n[len("net."):]: g for n, g in grads.items()}


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("make_net", [pytest.param(cnn_bn, marks=pytest.mark.slow), mlp_dropout],
                         ids=["batchnorm", "dropout-p0"])
def test_gradient_through_callback_matches_float64_reference(make_net):
    torch.manual_seed(0)
    net = make_net()
    loader, x, y = data(dtype=F64)
    cb = JacobianRegularizer(weight=LAM, n_projections=2, seed=3, module="net")
    U, _ = twin_u(cb.penalty, x)
    ref = reference_model(net)
    cap = GradCapture()
    make_trainer([cb, cap], precision="64-true").fit(Lit(net, lr=0.0), loader)

    y_ref, ts = ref_jvps(ref, x, U)
    (F.cross_entropy(y_ref, y) + LAM * sum(t.pow(2).sum() for t in ts) / (2 * 8)).backward()
    want = {n.replace(".bn.", "."): p.grad for n, p in ref.named_parameters()}
    got = strip(cap.grads[0])
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-11, msg=lambda m: f"{n}: {m}")


def test_float32_gradient_through_callback_close_to_float64():
    torch.manual_seed(0)
    net = cnn_bn()
    grads = {}
    for precision, dtype in (("32-true", torch.float32), ("64-true", F64)):
        loader, _, _ = data(dtype=dtype)
        cap = GradCapture()
        make_trainer([JacobianRegularizer(LAM, seed=1), cap], precision=precision).fit(Lit(copy.deepcopy(net), lr=0), loader)
        grads[precision] = cap.grads[0]
    for n, g in grads["64-true"].items():
        torch.testing.assert_close(grads["32-true"][n].double(), g, rtol=2e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_stacked_callbacks_share_one_forward_and_match_reference():
    torch.manual_seed(0)
    net = mlp_dropout()
    loader, x, y = data(dtype=F64)
    direction = torch.linspace(-1, 1, 16, dtype=F64).reshape(1, 4, 4)
    cbs = [JacobianRegularizer(0.3, seed=0),
           TangentPropRegularizer(0.2, transforms=("rotate", "translate_x")),
           ParameterSensitivityRegularizer(0.1, params="net.1.weight", seed=1),
           ConstraintRegularizer(direction, 0.4, kind="nonneg", power=2, margin=0.5)]
    U, _ = twin_u(cbs[0].penalty, x)
    T = TangentProp(("rotate", "translate_x")).directions(x, None)
    P = {n: u.to(F64) for n, u in twin_u(cbs[2].penalty, x, Lit(copy.deepcopy(net).double()))[1].items()}
    ref = reference_model(net)
    rows = []
    net[1].register_forward_hook(lambda m, a, o: rows.append(tuple(a[0].as_subclass(torch.Tensor).shape)))
    cap = GradCapture()
    model = Lit(net, lr=0.0)
    make_trainer([*cbs, cap], precision="64-true").fit(model, loader)
    assert rows == [(1 + 1 + 2 + 1 + 1, 8, 16)]  # ONE call of the first layer, with every block

    y_ref, (ju,) = ref_jvps(ref, x, U)
    _, jt = ref_jvps(ref, x, T)
    _, (jp,) = ref_jvps(ref, x, None, {n[len("net."):]: u for n, u in P.items()})
    _, (jc,) = ref_jvps(ref, x, direction.expand(8, 1, 4, 4)[None])
    loss = (F.cross_entropy(y_ref, y) + 0.3 * ju.pow(2).sum() / 8 + 0.2 * sum(t.pow(2).sum() for t in jt) / 8
            + 0.1 * jp.pow(2).sum() / 8 + 0.4 * F.relu(0.5 - jc).pow(2).sum() / 8)
    loss.backward()
    got = strip(cap.grads[0])
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-9, atol=1e-11, msg=lambda m: f"{n}: {m}")
    torch.testing.assert_close(model.seen_outputs[0], y_ref.detach(), rtol=0, atol=1e-12)


def test_batchnorm_running_stats_and_user_output_equal_a_plain_step():
    torch.manual_seed(0)
    net = cnn_bn()
    loader, x, _ = data()
    plain = copy.deepcopy(net).train()
    y_plain = plain(x)
    model = Lit(net, lr=0.0)
    make_trainer([JacobianRegularizer(1.0, n_projections=3), TangentPropRegularizer(1.0)]).fit(model, loader)
    for (n, b1), b2 in zip(net.named_buffers(), plain.buffers()):
        torch.testing.assert_close(b1, b2, rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")
    assert int(net[1].num_batches_tracked) == 1
    torch.testing.assert_close(model.seen_outputs[0], y_plain.detach(), rtol=1e-5, atol=1e-6)


def test_dropout_mask_is_shared_by_every_block_in_training():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Dropout(0.5))
    x = torch.rand(8, 1, 4, 4) + 0.5
    captured = {}

    class Spy(JacobianFrobenius):
        def penalty(self, jvp, context):
            captured["jvp"], captured["out"] = jvp.detach(), context.output.detach()
            return super().penalty(jvp, context)

    class Identity(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum() * 0 + self.dummy.sum()

        def configure_optimizers(self):
            return torch.optim.SGD([self.dummy], lr=0.0)

    m = Identity()
    m.dummy = nn.Parameter(torch.zeros(1))
    cb = JVPRegularizer(Spy(seed=0), 1.0, module="net")
    U, _ = twin_u(cb.penalty, x)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(8)), batch_size=8)
    make_trainer([cb]).fit(m, loader)
    keep = captured["out"] / x.flatten(1) * 0.5
    assert set(keep.unique().tolist()) <= {0.0, 1.0} and 0 < keep.mean() < 1
    torch.testing.assert_close(captured["jvp"][0], keep * U[0].flatten(1) / 0.5)


# --------------------------------------------------------------------------- options


def test_weight_schedules():
    const = JacobianRegularizer(2.0)
    lin = JacobianRegularizer(2.0, schedule="linear_warmup", warmup_steps=4)
    cos = JacobianRegularizer(2.0, schedule="cosine", warmup_steps=2, total_steps=12, final_weight=0.5)
    assert [const.weight_at(t) for t in (0, 100)] == [2.0, 2.0]
    assert [lin.weight_at(t) for t in range(6)] == [0.5, 1.0, 1.5, 2.0, 2.0, 2.0]
    assert cos.weight_at(0) == 1.0 and cos.weight_at(2) == 2.0
    assert cos.weight_at(7) == pytest.approx(0.5 + 1.5 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos.weight_at(12) == pytest.approx(0.5) and cos.weight_at(50) == pytest.approx(0.5)
    zero_end = JacobianRegularizer(1.0, schedule="cosine", total_steps=4)
    assert not zero_end.is_active(4) and zero_end.is_active(3)


def test_cosine_total_steps_defaults_to_estimated_stepping_batches_and_logs_weight():
    loader, _, _ = data(n=16, batch=4)
    cb = JacobianRegularizer(1.0, schedule="cosine")
    trainer = make_trainer([cb], max_steps=3)
    trainer.fit(Lit(mlp_dropout()), loader)
    assert cb._total_steps == 3
    assert float(trainer.callback_metrics["train/jacobian_frobenius_weight"]) == pytest.approx(cb.weight_at(2))
    assert torch.isfinite(trainer.callback_metrics["train/jacobian_frobenius"])


def test_every_n_steps_and_logs():
    loader, _, _ = data(n=16, batch=4)
    net = mlp_dropout()
    rows = []
    net[1].register_forward_hook(lambda m, a, o: rows.append(a[0].as_subclass(torch.Tensor).shape[0]))
    cb = JacobianRegularizer(0.5, every_n_steps=2, name="jac")
    trainer = make_trainer([cb], max_steps=4)
    trainer.fit(Lit(net, return_dict=True), loader)
    assert rows == [2, 4, 2, 4]  # clone forward (2 blocks) on steps 0 and 2, plain on 1 and 3
    assert cb.steps_applied == 2
    assert set(trainer.callback_metrics) >= {"train/jac", "train/jac_weight"}


def test_batch_fraction_regularizes_the_first_rows():
    torch.manual_seed(0)
    net = mlp_dropout()
    loader, x, _ = data(n=8, batch=8)
    cb = JacobianRegularizer(1.0, seed=0, batch_fraction=0.3)
    pen = copy.deepcopy(cb.penalty)
    expected = regularized_forward(copy.deepcopy(net), x, pen, batch_fraction=0.3)[1]
    make_trainer([cb]).fit(Lit(net, lr=0.0), loader)
    assert cb.last_value == pytest.approx(float(expected), rel=1e-6)


def test_bf16_mixed_precision():
    torch.manual_seed(0)
    net = cnn_bn()
    loader, x, y = data()
    cb = JacobianRegularizer(1.0, seed=0)
    _, ref_value = regularized_forward(copy.deepcopy(net), x, copy.deepcopy(cb.penalty))
    trainer = make_trainer([cb], precision="bf16-mixed", max_steps=1)
    trainer.fit(Lit(net, lr=0.0), loader)
    assert cb.steps_applied == 1
    assert cb.last_value == pytest.approx(float(ref_value), rel=0.05)


def test_gradient_accumulation_matches_manual_average():
    torch.manual_seed(0)
    net = mlp_dropout()
    loader, x, y = data(n=8, batch=4)
    cb = JacobianRegularizer(LAM, seed=0)
    pen, manual = copy.deepcopy(cb.penalty), copy.deepcopy(net)
    make_trainer([cb], accumulate_grad_batches=2).fit(Lit(net, lr=0.5), loader)
    for i in range(2):
        out, p = regularized_forward(manual, x[4 * i:4 * i + 4], pen)
        ((F.cross_entropy(out, y[4 * i:4 * i + 4]) + LAM * p) / 2).backward()
    with torch.no_grad():
        for p in manual.parameters():
            p -= 0.5 * p.grad
    for (n, a), b in zip(net.named_parameters(), manual.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_gradient_clipping_applies_to_the_regularized_gradient():
    torch.manual_seed(0)
    net = mlp_dropout()
    loader, x, y = data()
    cb = JacobianRegularizer(LAM, seed=0)
    pen, manual, before = copy.deepcopy(cb.penalty), copy.deepcopy(net), copy.deepcopy(net)
    make_trainer([cb], gradient_clip_val=1e-3).fit(Lit(net, lr=1.0), loader)
    out, p = regularized_forward(manual, x, pen)
    (F.cross_entropy(out, y) + LAM * p).backward()
    g = torch.cat([q.grad.flatten() for q in manual.parameters()])
    step = torch.cat([(b - a).flatten() for a, b in zip(net.parameters(), before.parameters())])
    assert g.norm() > 1e-2
    torch.testing.assert_close(step, g * 1e-3 / g.norm(), rtol=1e-3, atol=1e-8)


@pytest.mark.slow
def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path):
    def callbacks():
        return [JacobianRegularizer(0.5, seed=1), SpectralRegularizer(0.5, seed=2)]

    torch.manual_seed(0)
    net = cnn_bn()
    loader, _, _ = data(n=4, batch=4)  # one batch per epoch: Lightning's mid-epoch resume cannot reorder data
    full_cbs, full = callbacks(), Lit(copy.deepcopy(net))
    make_trainer(full_cbs, max_steps=4).fit(full, loader)

    first_cbs, first = callbacks(), Lit(copy.deepcopy(net))
    t1 = make_trainer(first_cbs, max_steps=2)
    t1.fit(first, loader)
    ckpt = tmp_path / "half.ckpt"
    t1.save_checkpoint(ckpt)
    assert first.__dict__.get("training_step") is None and not first.net._forward_pre_hooks

    restored = callbacks()
    make_trainer(restored, max_steps=2).fit(Lit(copy.deepcopy(net)), loader, ckpt_path=ckpt)  # restore only
    assert restored[1].steps_applied == 2
    torch.testing.assert_close(restored[1].penalty.vectors, first_cbs[1].penalty.vectors)

    second_cbs, second = callbacks(), Lit(copy.deepcopy(net))
    make_trainer(second_cbs, max_steps=4).fit(second, loader, ckpt_path=ckpt)
    for (n, a), b in zip(full.named_parameters(), second.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")
    torch.testing.assert_close(second_cbs[1].penalty.vectors, full_cbs[1].penalty.vectors, rtol=1e-5, atol=1e-6)
    assert [c.steps_applied for c in second_cbs] == [c.steps_applied for c in full_cbs] == [4, 4]


def test_spectral_vectors_move_and_estimate_grows_toward_sigma_max():
    torch.manual_seed(0)
    net = mlp_dropout()
    loader, x, _ = data(n=8, batch=8)
    cb = SpectralRegularizer(1e-9, seed=0)
    values = []

    class Rec(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            values.append(cb.last_value)

    make_trainer([cb, Rec()], max_steps=15).fit(Lit(net, lr=0.0), loader)
    jac = torch.func.vmap(torch.func.jacrev(lambda z: net(z[None])[0]))(x).flatten(2)
    sigma2 = float(torch.linalg.matrix_norm(jac, ord=2).pow(2).mean())
    assert values[0] < values[-1] <= sigma2 * (1 + 1e-5)
    assert values[-1] == pytest.approx(sigma2, rel=1e-3)


def test_constraint_direction_receives_batch_targets_and_dict_batches_work():
    seen = []

    def direction(x, y):
        seen.append(y.clone())
        return torch.ones_like(x)

    class DictLit(Lit):
        def forward(self, batch):
            return self.net(batch["image"])

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch), batch["label"])

    g = torch.Generator().manual_seed(0)
    items = [{"image": torch.randn(1, 4, 4, generator=g), "label": torch.tensor(i % 3)} for i in range(8)]
    loader = torch.utils.data.DataLoader(items, batch_size=8)
    cb = ConstraintRegularizer(direction, 1.0, input_key="image", target_key="label")
    make_trainer([cb]).fit(DictLit(mlp_dropout()), loader)
    assert torch.equal(seen[0], torch.arange(8) % 3) and cb.steps_applied == 1


def test_validation_logs_jacobian_frobenius_estimate():
    torch.manual_seed(0)
    net = mlp_dropout()
    loader, x, _ = data(n=64, batch=64)
    trainer = make_trainer([JacobianRegularizer(1e-3, log_val_jacobian=True)], max_steps=1, limit_val_batches=1)
    trainer.fit(Lit(net, lr=0.0), loader, loader)
    net.eval()
    # the estimate for its seed: JacobianFrobenius(seed=0)'s first draw u (one projection, float32), sqrt(|J u|^2 / m)
    u = torch.randn((1, *x.shape), generator=torch.Generator().manual_seed(0))[0]
    _, ju = torch.func.jvp(net, (x,), (u,))
    want = (ju.pow(2).sum() / x.shape[0]).sqrt()
    logged = float(trainer.callback_metrics["val/jacobian_fro"])
    assert logged == pytest.approx(float(want), rel=1e-5)
    exact = torch.func.vmap(torch.func.jacrev(lambda z: net(z[None])[0]))(x).pow(2).sum((1, 2, 3, 4)).mean().sqrt()
    assert 0.6 * float(exact) < logged < 1.5 * float(exact)  # and it estimates the norm


def test_manual_optimization_with_regularized_forward():
    class Manual(Lit):
        def __init__(self, net):
            super().__init__(net)
            self.automatic_optimization = False
            self.pen = JacobianFrobenius(seed=0)

        def training_step(self, batch, batch_idx):
            x, y = batch
            out, pen = regularized_forward(self.net, x, self.pen)
            loss = F.cross_entropy(out, y) + 0.1 * pen
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.log("pen", pen.detach())

    loader, _, _ = data(n=8, batch=4)
    trainer = make_trainer(max_steps=2)
    trainer.fit(Manual(cnn_bn()), loader)
    assert torch.isfinite(trainer.callback_metrics["pen"])
    with pytest.raises(NotImplementedError, match=r"JacobianRegularizer\(name='jacobian_frobenius'\): only implemented "
                                                  r"for automatic optimization; .* Call jvpreg.callbacks."
                                                  r"regularized_forward\(model, x, penalty\)"):
        make_trainer([JacobianRegularizer(1.0)]).fit(Manual(cnn_bn()), loader)


def test_restores_training_step_and_hooks_after_an_exception():
    class Boom(Lit):
        def training_step(self, batch, batch_idx):
            self(batch[0])
            raise ArithmeticError("boom")

    loader, _, _ = data()
    model = Boom(mlp_dropout())
    with pytest.raises(ArithmeticError, match="boom"):
        make_trainer([JacobianRegularizer(1.0, module="net")]).fit(model, loader)
    assert "training_step" not in model.__dict__ and not model.net._forward_pre_hooks and not model.net._forward_hooks
    assert all(type(p) is nn.Parameter for p in model.parameters())

    class Exploding(nn.Module):  # fails inside the cloned forward, with swapped (clone) weights
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 3)

        def forward(self, x):
            self.lin(x.flatten(1))
            raise ArithmeticError("inside")

    model = Lit(Exploding())
    with pytest.raises(ArithmeticError, match="inside"):
        make_trainer([ParameterSensitivityRegularizer(1.0, params="lin.weight", module="net")]).fit(model, loader)
    assert all(type(p) is nn.Parameter for p in model.parameters()) and "training_step" not in model.__dict__


# --------------------------------------------------------------------------- state


CALLBACKS = {
    "JVPRegularizer": lambda: JVPRegularizer(Stack([JacobianFrobenius(seed=0), TangentProp("rotate")]), 0.1),
    "JacobianRegularizer": lambda: JacobianRegularizer(0.1, seed=1),
    "TangentPropRegularizer": lambda: TangentPropRegularizer(0.1),
    "ConstraintRegularizer": lambda: ConstraintRegularizer(torch.ones(1, 4, 4), 0.1),
    "ParameterSensitivityRegularizer": lambda: ParameterSensitivityRegularizer(0.1, params="net.1.*", seed=2),
    "SpectralRegularizer": lambda: SpectralRegularizer(0.1, n_iter=2, seed=3),
}


def _assert_same_state(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_same_state(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_state_dict_round_trip(name):
    loader, _, _ = data()
    cb = CALLBACKS[name]()
    make_trainer([cb]).fit(Lit(mlp_dropout()), loader)
    state = cb.state_dict()
    assert state["steps_applied"] == 1
    fresh = CALLBACKS[name]()
    fresh.load_state_dict(copy.deepcopy(state))
    _assert_same_state(fresh.state_dict(), state)
    assert fresh.state_key == cb.state_key
    assert cb.state_key.startswith(f"{name}{{'name': '{cb.name}', 'config': '")


def test_distinct_state_keys_without_names_and_identical_duplicates_rejected():
    a, b = JacobianRegularizer(1.0), JacobianRegularizer(2.0)
    assert a.state_key != b.state_key and a.name == b.name
    assert JacobianRegularizer(1.0).state_key == a.state_key  # one configuration, one key
    loader, _, _ = data()
    with pytest.raises(RuntimeError, match=r"Found more than one stateful callback of type `JacobianRegularizer`.*"
                                           r"The `callback.state_key` must be unique"):  # identical twins only
        make_trainer([JacobianRegularizer(1.0), JacobianRegularizer(1.0)])
    trainer = make_trainer([a, b])
    trainer.fit(Lit(mlp_dropout()), loader)
    assert a.steps_applied == b.steps_applied == 1
    assert (a.log_name, b.log_name) == ("jacobian_frobenius", "jacobian_frobenius_2")
    assert {"train/jacobian_frobenius", "train/jacobian_frobenius_2"} <= set(trainer.callback_metrics)


# --------------------------------------------------------------------------- errors

INIT_ERRORS = [
    (lambda: JVPRegularizer(nn.Linear(2, 2), 1.0), TypeError,
     r"JVPRegularizer\(\.\.\.\): expected penalty to be a jvpreg.losses.JVPPenalty or Stack, got Linear"),
    (lambda: JacobianRegularizer(-1.0), ValueError,
     r"JacobianRegularizer\(\.\.\.\): expected weight to be a number in \[0.0, inf\], got -1.0"),
    (lambda: JacobianRegularizer("1"), TypeError, r"expected weight to be a number in \[0.0, inf\], got str '1'"),
    (lambda: JacobianRegularizer(1.0, schedule="step"), ValueError,
     r"expected schedule to be one of 'constant', 'linear_warmup', 'cosine'; got 'step'"),
    (lambda: JacobianRegularizer(1.0, schedule="linear_warmup"), ValueError,
     r"schedule='linear_warmup' needs warmup_steps >= 1, got 0"),
    (lambda: JacobianRegularizer(1.0, warmup_steps=-1), ValueError, r"expected warmup_steps to be an int >= 0, got -1"),
    (lambda: JacobianRegularizer(1.0, schedule="cosine", warmup_steps=5, total_steps=5), ValueError,
     r"expected total_steps > warmup_steps for schedule='cosine', got total_steps=5, warmup_steps=5"),
    (lambda: JacobianRegularizer(1.0, total_steps=0), ValueError, r"expected total_steps to be an int >= 1, got 0"),
    (lambda: JacobianRegularizer(1.0, every_n_steps=0), ValueError, r"expected every_n_steps to be an int >= 1, got 0"),
    (lambda: JacobianRegularizer(1.0, batch_fraction=0.0), ValueError,
     r"expected batch_fraction to be a number in \(0.0, 1.0\], got 0.0"),
    (lambda: JacobianRegularizer(1.0, module=""), TypeError,
     r"expected module to be None or a non-empty attribute path str, got ''"),
    (lambda: JacobianRegularizer(1.0, input_index=-1), ValueError, r"expected input_index to be an int >= 0, got -1"),
    (lambda: JacobianRegularizer(1.0, input_key=3), TypeError, r"expected input_key to be None or a non-empty str, got 3"),
    (lambda: JacobianRegularizer(1.0, target_index=1.0), TypeError, r"expected target_index to be an int >= 0, got float"),
    (lambda: JacobianRegularizer(1.0, name=""), TypeError, r"expected name to be None or a non-empty str, got ''"),
    (lambda: JacobianRegularizer(1.0, log_val_jacobian=1), TypeError, r"expected log_val_jacobian to be a bool, got 1"),
    (lambda: JacobianRegularizer(1.0, n_projections=0), ValueError,
     r"JacobianFrobenius\(\.\.\.\): expected n_projections to be an int >= 1, got 0"),
    (lambda: TangentPropRegularizer(1.0, transforms="shear"), ValueError, r"expected each transform to be one of"),
    (lambda: ConstraintRegularizer(None, 1.0), TypeError, r"expected direction to be a callable direction\(x, y\)"),
    (lambda: ParameterSensitivityRegularizer(1.0, params=[]), ValueError, r"expected at least one parameter name pattern"),
    (lambda: SpectralRegularizer(1.0, n_iter=0), ValueError, r"expected n_iter to be an int >= 1, got 0"),
]


@pytest.mark.parametrize("make,exc,match", INIT_ERRORS, ids=[f"init-{i}" for i in range(len(INIT_ERRORS))])
def test_init_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_init_does_not_mutate_arguments():
    members = [JacobianFrobenius(), TangentProp()]
    stack = Stack(members, weights=[1.0, 2.0])
    kwargs = {"schedule": "cosine", "total_steps": 10}
    JVPRegularizer(stack, 1.0, batch_fraction=0.5, **kwargs)
    assert kwargs == {"schedule": "cosine", "total_steps": 10} and stack.terms[1][1:] == (2.0, 1.0)


def test_runtime_errors():
    loader, _, _ = data()
    with pytest.raises(ValueError, match=r"module='nte' is not a submodule of Lit. Did you mean 'net'\?"):
        make_trainer([JacobianRegularizer(1.0, module="nte")]).fit(Lit(mlp_dropout()), loader)

    class Direct(Lit):
        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

    with pytest.raises(RuntimeError, match=r"the regularized module '<the LightningModule>' was not called during "
                                           r"training_step.*Pass module='<attribute path>'"):
        make_trainer([JacobianRegularizer(1.0)]).fit(Direct(mlp_dropout()), loader)

    class BadReturn(Lit):
        def training_step(self, batch, batch_idx):
            return [F.cross_entropy(self(batch[0]), batch[1])]

    with pytest.raises(TypeError, match=r"training_step must return a loss tensor or a dict with a 'loss' tensor"):
        make_trainer([JacobianRegularizer(1.0)]).fit(BadReturn(mlp_dropout()), loader)
    with pytest.raises(ValueError, match=r"Lit.forward got 1 positional argument\(s\) and keyword\(s\) \[\]; "
                                         r"input_index=2 does not select the input"):
        make_trainer([JacobianRegularizer(1.0, input_index=2)]).fit(Lit(mlp_dropout()), loader)
    with pytest.raises(ValueError, match=r"regularizers of module=None must agree on the input"):
        make_trainer([JacobianRegularizer(1.0), TangentPropRegularizer(1.0, input_key="x")]).fit(Lit(mlp_dropout()),
                                                                                               loader)
    cosine = JacobianRegularizer(1.0, schedule="cosine")
    with pytest.raises(ValueError, match=r"schedule='cosine' needs total_steps= when the Trainer has no "
                                         r"max_steps/max_epochs limit"):
        make_trainer([cosine], max_steps=-1, max_epochs=-1).fit(Lit(mlp_dropout()), loader)


# --------------------------------------------------------------------------- a short training run


@pytest.mark.slow
def test_training_lowers_jacobian_norm_at_comparable_accuracy():
    """sklearn digits, MLP, 4 epochs: the regularizer cuts ||J||_F (jacrev reference) by >= 2x."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    X = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    Y = torch.tensor(digits.target)
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
    train, test = perm[:1400], perm[1400:]

    class Digits(Lit):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    results = {}
    for weight in (0.0, 5e-3):
        torch.manual_seed(0)
        model = Digits(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X[train], Y[train]), batch_size=64,
                                             shuffle=True, generator=torch.Generator().manual_seed(0))
        cbs = [JacobianRegularizer(weight, seed=0, module="net")] if weight else []
        make_trainer(cbs, max_steps=-1, max_epochs=4).fit(model, loader)
        net = model.net.eval()
        with torch.no_grad():
            acc = (net(X[test]).argmax(1) == Y[test]).float().mean().item()
        jac = torch.func.vmap(torch.func.jacrev(lambda z: net(z[None])[0]))(X[test])
        results[weight] = (acc, jac.pow(2).sum((1, 2)).mean().sqrt().item())
    (acc0, jac0), (acc1, jac1) = results[0.0], results[5e-3]
    assert jac0 / jac1 >= 2.0, results
    assert acc1 >= acc0 - 0.03 and acc1 > 0.85, results


def test_shared_forward_without_lightning_and_its_errors():
    from jvpreg.callbacks import SharedForward

    torch.manual_seed(0)
    net = mlp_dropout()
    x = torch.randn(4, 1, 4, 4)
    shared = SharedForward(net)
    with pytest.raises(RuntimeError, match=r"SharedForward: Sequential was not called since arm\(\)"):
        shared.total()
    pen = JacobianFrobenius(seed=0)
    shared.arm([(copy.deepcopy(pen), 2.0, 1.0)])
    out = net(x)
    torch.testing.assert_close(out, net(x))  # second call: passes through, plain
    torch.testing.assert_close(shared.total(), 2.0 * regularized_forward(net, x, pen)[1])
    shared.remove()
    assert not net._forward_pre_hooks and not net._forward_hooks

    class DictNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp_dropout()

        def forward(self, batch):
            return self.net(batch["image"])

    model = DictNet()
    shared = SharedForward(model, input_key="pixels")
    shared.arm([(JacobianFrobenius(), 1.0, 1.0)])
    with pytest.raises(ValueError, match=r"input_key='pixels' is not a key of the dict passed to DictNet.forward "
                                         r"at input_index=0; its keys: 'image'. Set input_key to one of them"):
        model({"image": x})
    shared.remove()


def test_model_with_inplace_relu_matches_out_of_place():
    """torchvision-style ReLU(inplace=True) inside the cloned forward: same gradients as out-of-place."""
    grads = []
    for inplace in (True, False):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(inplace=inplace), nn.Flatten(), nn.Linear(8, 3))
        loader, _, _ = data()
        cap = GradCapture()
        make_trainer([JacobianRegularizer(0.1, seed=0), cap]).fit(Lit(net, lr=0.0), loader)
        grads.append(cap.grads[0])
    for n, g in grads[1].items():
        torch.testing.assert_close(grads[0][n], g, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
