"""MeanFlowLoss against the reference formulation (float64): torch.func.jvp under the math attention backend (or
torch.autograd.functional.jvp where BatchNorm is in train mode), then a separate forward with gradients."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import assert_tree_close
from jvpreg.losses import MeanFlowLoss, adaptive_l2, sample_times
from jvpreg.models import DiT, TimeUNet, build_model

D = torch.float64
B = 6


def _randomized(net: nn.Module, seed: int = 0) -> nn.Module:
    """``net`` in float64 with every parameter drawn anew (no zero-initialised layer hides a gradient)."""
    g = torch.Generator().manual_seed(seed)
    net = net.to(D)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=D) * 0.3)
    return net


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, 1, 8, 8, generator=g, dtype=D)
    e = torch.randn(B, 1, 8, 8, generator=g, dtype=D)
    t = torch.rand(B, generator=g, dtype=D)
    r = t * torch.rand(B, generator=g, dtype=D)
    r[0] = t[0]  # one r = t sample
    y = torch.randint(0, 10, (B,), generator=g)
    return x, e, r, t, y


def reference_loss(model, x, e, r, t, y, *, p=1.0, c=1e-3, jvp="func", order="rt"):
    """The mean-flow loss written out: z, v, du/dt by torch's JVP, a second forward for u, adaptive L2."""
    tb = t[:, None, None, None]
    z, v = (1 - tb) * x + tb * e, e - x
    times, tans = ((r, t), (torch.zeros_like(r), torch.ones_like(t)))
    if order == "tr":
        times, tans = times[::-1], tans[::-1]

    def f(z_, a, b):
        return model(z_, a, b, y=y)

    if jvp == "func":
        with sdpa_kernel(SDPBackend.MATH):
            _, dudt = torch.func.jvp(f, (z, *times), (v, *tans))
    else:
        _, dudt = torch.autograd.functional.jvp(f, (z, *times), (v, *tans))
    u = f(z, *times)
    delta = u - (v - (t - r)[:, None, None, None] * dudt).detach()
    sq = delta.pow(2).sum((1, 2, 3))
    return ((sq.detach() + c).pow(-p) * sq).mean()


def _grads(loss, net):
    """All parameter gradients as one vector: tolerances relative to its largest entry (a conv bias before a
    GroupNorm has gradient zero up to rounding, ~1e-19, which no per-tensor relative tolerance can compare)."""
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(net.parameters()))])


MODELS = [
    dict(id="dit", build=lambda: DiT(1, 8, patch_size=2, dim=16, depth=2, heads=2, zero_init=False)),
    dict(id="unet_group", build=lambda: TimeUNet(1, 4, norm="group")),
]


@pytest.mark.parametrize("setting", MODELS, ids=[s["id"] for s in MODELS])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "separate"])
@pytest.mark.slow
def test_loss_and_grads_match_reference(setting, shared):
    net = _randomized(setting["build"]())
    x, e, r, t, y = _batch()
    want = reference_loss(net, x, e, r, t, y)
    want_g = _grads(want, net)
    # shared: "auto" runs eager on the first call of a signature and the captured program from the second;
    # separate: the captured program alone (its steady state), to keep the file fast
    loss_fn = MeanFlowLoss(shared_forward=shared, engine="auto" if shared else "captured")
    for call in range(2 if shared else 1):
        got = loss_fn(net, x, y, r=r, t=t, noise=e).loss
        assert_tree_close(got, want, what=f"loss (call {call})")
        assert_tree_close(_grads(got, net), want_g, what=f"grads (call {call})")


@pytest.mark.slow
def test_stop_gradient_is_what_the_test_sees():
    """Without the stop-gradient the gradients differ by far more than the tolerance: the comparison above can fail."""
    net = _randomized(MODELS[0]["build"]())
    x, e, r, t, y = _batch()
    got = _grads(MeanFlowLoss(shared_forward=True, engine="eager")(net, x, y, r=r, t=t, noise=e).loss, net)
    tb = t[:, None, None, None]
    z, v = (1 - tb) * x + tb * e, e - x
    with sdpa_kernel(SDPBackend.MATH):
        u, dudt = torch.func.jvp(lambda a, b, c: net(a, b, c, y=y), (z, r, t),
                                 (v, torch.zeros_like(r), torch.ones_like(t)))
    sq = (u - (v - (t - r)[:, None, None, None] * dudt)).pow(2).sum((1, 2, 3))
    no_sg = _grads(((sq.detach() + 1e-3).pow(-1) * sq).mean(), net)
    assert max((a - b).abs().max().item() for a, b in zip(got, no_sg)) > 1e-3


def test_time_order_tr_and_adaptive_power():
    class SwappedTimes(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, z, t, r, y=None):
            return self.inner(z, r, t, y)

    net = _randomized(MODELS[0]["build"]())
    x, e, r, t, y = _batch(2)
    want = reference_loss(net, x, e, r, t, y, p=0.5, c=0.1)
    got = MeanFlowLoss(time_order="tr", adaptive_p=0.5, adaptive_c=0.1)(SwappedTimes(net), x, y, r=r, t=t, noise=e)
    assert_tree_close(got.loss, want)
    assert_tree_close(_grads(got.loss, net), _grads(want, net))


def test_train_mode_batchnorm_matches_double_backward_and_updates_stats_once():
    net = _randomized(TimeUNet(1, 4, norm="batch")).train()
    plain = _randomized(TimeUNet(1, 4, norm="batch")).train()
    ref = _randomized(TimeUNet(1, 4, norm="batch")).train()
    x, e, r, t, y = _batch(3)
    want = reference_loss(ref, x, e, r, t, y, jvp="autograd")
    got = MeanFlowLoss(shared_forward=True)(net, x, y, r=r, t=t, noise=e)
    assert_tree_close(got.loss, want)
    assert_tree_close(_grads(got.loss, net), _grads(want, ref))
    plain(got.z, r, t, y=y)  # one plain forward: the running statistics the shared forward must leave
    for (name, a), b in zip(net.named_buffers(), plain.buffers()):
        assert_tree_close(a, b, what=name)


def test_dropout_one_mask_for_u_and_its_derivative():
    """With dropout, the shared forward differentiates the very function (mask) whose output it trains; the
    separate one draws a second mask for u (as the references do)."""
    net = _randomized(DiT(1, 8, dim=16, depth=1, heads=2, zero_init=False))
    net.blocks[0].mlp.insert(1, nn.Dropout(0.3))
    x, e, r, t, y = _batch(4)
    torch.manual_seed(5)
    got = MeanFlowLoss(shared_forward=True)(net, x, y, r=r, t=t, noise=e)
    torch.manual_seed(5)
    u = net(got.z, r, t, y=y)
    torch.manual_seed(5)
    v = e - x
    with sdpa_kernel(SDPBackend.MATH):
        _, dudt = torch.func.jvp(lambda a, b, c: net(a, b, c, y=y), (got.z, r, t),
                                 (v, torch.zeros_like(r), torch.ones_like(t)))
    assert_tree_close(got.u, u)
    assert_tree_close(got.target, v - (t - r)[:, None, None, None] * dudt)
    torch.manual_seed(5)
    separate = MeanFlowLoss()(net, x, y, r=r, t=t, noise=e)
    assert_tree_close(separate.target, got.target)
    assert (separate.u - u).abs().max() > 1e-3


@pytest.mark.parametrize("method", ["torch.func", "autograd"])
def test_reference_methods_agree(method):
    net = _randomized(MODELS[0]["build"]())
    x, e, r, t, y = _batch(6)
    want = reference_loss(net, x, e, r, t, y)
    assert_tree_close(MeanFlowLoss(method=method)(net, x, y, r=r, t=t, noise=e).loss, want)


def test_consistency_objective_is_r_zero():
    net = _randomized(MODELS[1]["build"]())
    x, e, _, t, y = _batch(7)
    got = MeanFlowLoss(objective="consistency", seed=0)(net, x, y, noise=e)
    assert torch.all(got.r == 0) and torch.all(got.t > 0)
    want = reference_loss(net, x, e, torch.zeros_like(got.t), got.t, y)
    assert_tree_close(got.loss, want)


def test_label_dropout_uses_null_label_and_is_passed_to_the_model():
    seen = []

    class Spy(nn.Module):
        null_label = 10

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(1, 1)

        def forward(self, z, r, t, y=None, scale=None):
            seen.append((y.clone(), scale))
            return z * self.lin.weight

    x = torch.rand(400, 1, 2, 2)
    y = torch.zeros(400, dtype=torch.long)
    MeanFlowLoss(label_dropout=0.25, seed=0, engine="eager")(Spy(), x, y, model_kwargs={"scale": 2.0})
    labels, scale = seen[0]
    assert scale == 2.0 and set(labels.tolist()) == {0, 10}
    assert 0.15 < (labels == 10).float().mean().item() < 0.35
    assert torch.equal(y, torch.zeros(400, dtype=torch.long))  # the caller's labels are not modified


def test_sample_times():
    g = torch.Generator().manual_seed(0)
    r, t = sample_times(4000, equal_fraction=0.75, generator=g)
    assert torch.all((0 <= r) & (r <= t) & (t <= 1))
    assert 0.72 < (r == t).float().mean().item() < 0.78
    r, t = sample_times(4000, distribution="uniform", equal_fraction=0.0, generator=g)
    assert (r == t).float().mean().item() == 0.0 and 0.6 < t.mean().item() < 0.73  # E max(U1, U2) = 2/3


def test_adaptive_l2():
    delta = torch.tensor([[1.0, 1.0], [0.0, 2.0]], dtype=D)
    loss, mse = adaptive_l2(delta, p=1.0, c=1.0)
    assert_tree_close(loss, torch.tensor((2 / 3 + 4 / 5) / 2, dtype=D))
    assert_tree_close(mse, torch.tensor(3.0, dtype=D))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(objective="sCM"), ValueError, "objective to be one of 'meanflow', 'consistency'"),
    (dict(time_order="zrt"), ValueError, "time_order to be one of 'rt', 'tr'"),
    (dict(adaptive_p=-1), ValueError, r"adaptive_p to be a number in \[0.0, inf\]"),
    (dict(adaptive_c=0), ValueError, "adaptive_c"),
    (dict(label_dropout=1.0), ValueError, "label_dropout"),
    (dict(label_key="y-label"), TypeError, "label_key to be a keyword name"),
    (dict(shared_forward=1), TypeError, "shared_forward to be a bool"),
    (dict(method="jax"), ValueError, "method to be one of"),
    (dict(equal_fraction=1.5), ValueError, "equal_fraction"),
])
def test_init_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        MeanFlowLoss(**kwargs)


def test_call_errors():
    net = TimeUNet(1, 4, num_classes=None)
    x = torch.rand(2, 1, 4, 4)
    with pytest.raises(ValueError, match="pass both r and t"):
        MeanFlowLoss()(net, x, t=torch.rand(2))
    with pytest.raises(ValueError, match=r"expected r of shape \(2,\)"):
        MeanFlowLoss()(net, x, r=torch.rand(3), t=torch.rand(3))
    with pytest.raises(TypeError, match="expected model to be an nn.Module"):
        MeanFlowLoss()(lambda *a: a[0], x)
    with pytest.raises(ValueError, match="pass null_label="):
        MeanFlowLoss(label_dropout=0.1)(nn.Identity(), x, torch.zeros(2, dtype=torch.long))


def test_registry_builds_dit_and_time_unet():
    dit = build_model("dit", in_channels=1, num_classes=10, image_size=8, dim=32, depth=1, heads=2)
    assert dit(torch.rand(2, 1, 8, 8), torch.zeros(2), torch.ones(2), torch.tensor([1, 10])).shape == (2, 1, 8, 8)
    unet = build_model("time_unet", in_channels=1, num_classes=None, image_size=8, norm="batch")
    assert unet(torch.rand(2, 1, 8, 8), torch.zeros(2), torch.ones(2)).shape == (2, 1, 8, 8)
    with pytest.raises(ValueError, match="divisible by the patch size"):
        DiT(1, 7, patch_size=2)


@pytest.mark.slow
def test_digits_meanflow_experiment_runs(tmp_path, monkeypatch):
    """``experiment=digits_meanflow`` end to end on two epochs: figures, quality scores and metrics are written."""
    import json

    from hydra import compose, initialize_config_module

    from jvpreg.generative.run import train_generative

    monkeypatch.setenv("WANDB_MODE", "disabled")
    tmp = str(tmp_path)
    with initialize_config_module("jvpreg.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.root_dir={tmp}", f"paths.work_dir={tmp}",
                                          f"paths.output_dir={tmp}/out", "experiment=digits_meanflow", "logger=csv",
                                          "trainer.max_epochs=2",
                                          "trainer.check_val_every_n_epoch=1", "trainer.enable_progress_bar=false",
                                          "generative.samples_per_class=5", "model.depth=1"])
    result, _ = train_generative(cfg)
    for key in ("samples", "quality", "loss_curves", "metrics_json"):
        assert os.path.getsize(result["paths"][key]) > 0, key
    quality = json.load(open(os.path.join(tmp, "out", "quality.json")))
    assert set(quality) == {"1 step", "2 steps", "real test"}
    assert quality["real test"]["acc"] > 0.9  # the classifier itself works
    assert "val/mse" in result["metrics"] and result["steps"] > 0


def test_docs_snippet_runs():
    """docs/meanflow.md's call, as users write it, runs on a one-batch loader."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "meanflow.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    g = torch.Generator().manual_seed(0)
    scope = {"loader": [(torch.rand(8, 1, 8, 8, generator=g) * 2 - 1, torch.arange(8))]}
    exec(compile(code, "docs/meanflow.md", "exec"), scope)
    assert scope["x1"].shape == scope["x2"].shape == (16, 1, 8, 8)
    assert torch.isfinite(scope["out"].loss) and all(p.grad is not None for p in scope["net"].parameters())
