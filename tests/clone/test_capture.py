"""Captured clone mode (jvpreg.clone.program.capture): same numbers as eager clone mode, guards, fallbacks."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torchvision
from torch import nn

import jvpreg
from jvpreg.clone import JVPCaptureWarning, fallback_mode
from jvpreg.clone.program import capture
from jvpreg.clone.core.device_paths import accelerator_path
from jvpreg.losses import JacobianFrobenius, Stack, TangentProp, regularized_forward
from jvpreg.models import build_model
from conftest import count_captures

D = torch.float64
DEFAULT_EAGER_CALLS = capture.EAGER_CALLS_BEFORE_CAPTURE


@pytest.fixture(autouse=True)
def capture_on_first_call(monkeypatch):
    """These tests are about captured programs: ``engine="auto"`` captures on the first call here (see
    ``test_auto_runs_a_new_signature_eagerly_once_then_captures`` for the default)."""
    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", 0)


def randn(*shape, dtype=D):
    return torch.randn(*shape, dtype=dtype)


class Branchy(nn.Module):
    """Python control flow on the value of a random draw: cannot be re-checked before a replay, so not captured."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        keep = torch.rand(()) < 2  # always true, but drawn at random: the guard cannot recompute it first
        return torch.relu(h) if keep and h.sum() > 0 else torch.tanh(h)


class Straight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class WithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + Straight.apply(self.lin.weight).sum()


def _vit():
    return torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                                                hidden_dim=16, mlp_dim=32, num_classes=5)


class Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(5, 6, num_layers=2, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


ZOO = {
    "mlp-relu": (lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)), (5, 6)),
    "cnn-bn-maxpool": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                              nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 3)), (4, 2, 4, 4)),
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=4), (2, 3, 32, 32)),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=4), (2, 3, 32, 32)),
    "vit": (_vit, (2, 3, 16, 16)),
    "lstm": (lambda: Recurrent(nn.LSTM), (3, 4, 5)),
    "gru": (lambda: Recurrent(nn.GRU), (3, 4, 5)),
    "unet": (lambda: build_model("unet", in_channels=1, num_classes=2, image_size=16), (2, 1, 16, 16)),
}
SLOW = {"densenet121": (lambda: torchvision.models.densenet121(num_classes=4), (2, 3, 32, 32)),
        "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(num_classes=4), (2, 3, 32, 32)),
        "vgg11_bn": (lambda: torchvision.models.vgg11_bn(num_classes=4), (2, 3, 32, 32))}


def _zoo_params():
    for name in ZOO:
        for mode in ("train", "eval"):  # the quick tier: the two small models
            slow = name not in ("mlp-relu", "cnn-bn-maxpool")
            yield pytest.param(name, mode, ZOO[name], id=f"{name}-{mode}", marks=pytest.mark.sweep if slow else ())
    for name in SLOW:
        for mode in ("train", "eval"):
            yield pytest.param(name, mode, SLOW[name], id=f"{name}-{mode}", marks=pytest.mark.sweep)


def _dropout_free(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


@pytest.mark.parametrize("name, mode, spec", list(_zoo_params()))
def test_captured_equals_eager_on_the_zoo(name, mode, spec):
    """float64: output, JVP (two tangents) and BatchNorm buffers of the captured replay equal eager clone mode."""
    torch.manual_seed(0)
    build, shape = spec
    model = _dropout_free(build().to(D))
    model.train(mode == "train")
    x, us = randn(*shape), randn(2, *shape)
    eager = copy.deepcopy(model)
    with warnings.catch_warnings(), count_captures() as n:
        warnings.simplefilter("error", JVPCaptureWarning)
        for i in range(2):  # capture, then replay; the same random draws (stochastic depth) for both
            torch.manual_seed(i)
            y, t = jvpreg.jvp(model, (x,), (us,), batched_tangents=True, engine="captured")
            torch.manual_seed(i)
            y_e, t_e = jvpreg.jvp(eager, (x,), (us,), batched_tangents=True, engine="eager")
            torch.testing.assert_close(y, y_e, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)
    assert n.recorded == 1 and len(capture.programs(model)) == 1
    n.ran_programs(2)
    for (n, b), b_e in zip(model.named_buffers(), eager.buffers()):
        assert torch.equal(b, b_e), n


@pytest.mark.slow
def test_captured_running_stats_bitwise_equal_to_plain_forward():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4).train()
    plain = copy.deepcopy(model)
    x, u = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)
    for _ in range(2):
        jvpreg.jvp(model, (x,), (u,))
        plain(x)
    for (n, b), b_p in zip(model.named_buffers(), plain.buffers()):
        assert torch.equal(b, b_p), n


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_captured_penalty_gradients_equal_eager_and_torch_func(mode):
    """Gradients of ||J u||^2 + sum f(x) through the replay equal eager clone mode (and torch.func in eval)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.BatchNorm1d(7), nn.ReLU(),
                          nn.Linear(7, 2)).to(D).train(mode == "train")
    x, u = randn(6, 5), randn(6, 5)

    def grads(engine):
        m = copy.deepcopy(model)
        for _ in range(2):  # the second call replays
            m.zero_grad()
            y, t = jvpreg.jvp(m, (x,), (u,), engine=engine)
            (t.pow(2).sum() + y.sum()).backward()
        return [p.grad for p in m.parameters()]

    for g, g_e in zip(grads("captured"), grads("eager")):
        torch.testing.assert_close(g, g_e, rtol=1e-12, atol=1e-12)
    if mode == "eval":
        m = copy.deepcopy(model)
        y, t = torch.func.jvp(m, (x,), (u,))
        (t.pow(2).sum() + y.sum()).backward()
        for g, p in zip(grads("captured"), m.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("engine", ["captured", pytest.param("compiled", marks=pytest.mark.slow)])
def test_scales_chosen_by_kernels_are_recorded_in_the_jvp_program(engine):
    """On an accelerator the scales are kernels (:func:`jvpreg.clone.api.device_scales`) and a JVP's program records
    them with the rest (a compiled program fuses them): run here on the CPU taking that path
    (:func:`jvpreg.clone.core.device_paths.accelerator_path`). The program then
    reads ``x`` and ``u`` only (no scale input), computes ``||x||`` and ``||u||`` itself, and gives the JVP of the
    host-chosen scales and torch.func's, with tangents of sizes 1e-20 to 1e20 (scales that differ by 2^130)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.ReLU(), nn.Linear(7, 2)).to(D).eval()
    x, u = randn(6, 5), randn(6, 5)
    sizes = (1e-20, 1.0, 1e20)
    ref = {size: torch.func.jvp(model, (x,), (size * u,)) for size in sizes}
    host = {size: jvpreg.jvp(model, (x,), (size * u,), engine=engine) for size in sizes}
    capture.reset(model)
    with accelerator_path():
        for _ in range(2):  # a capture, then a replay
            for size, (y_ref, t_ref) in ref.items():
                y, t = jvpreg.jvp(model, (x,), (size * u,), engine=engine)
                torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(t / size, t_ref / size, rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(t, host[size][1], rtol=1e-12, atol=0)
    (program,) = [p for p in capture.programs(model).values() if p.gm is not None]
    targets = {str(n.target) for n in program.gm.graph.nodes if n.op == "call_function"}
    assert "aten.linalg_vector_norm.default" in targets and "aten.exp2.default" in targets
    assert len([n for n in program.gm.graph.nodes if n.op == "placeholder"]) == 2 + len(list(model.parameters()))


@pytest.mark.slow
def test_cache_hit_and_recapture_on_changed_guards():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU()).to(D)
    x, u = randn(3, 4), randn(3, 4)
    jvpreg.jvp(model, (x,), (u,))
    (prog,) = capture.programs(model).values()
    jvpreg.jvp(model, (x,), (u,))
    assert list(capture.programs(model).values()) == [prog]  # hit: the same program object
    jvpreg.jvp(model, (randn(5, 4),), (randn(5, 4),))  # shape
    assert len(capture.programs(model)) == 2
    model.eval()
    jvpreg.jvp(model, (x,), (u,))  # mode
    assert len(capture.programs(model)) == 3
    model.float()
    y, t = jvpreg.jvp(model, (x.float(),), (u.float(),))  # dtype (parameters replaced -> recapture)
    assert t.dtype == torch.float32 and len(capture.programs(model)) == 4
    with torch.no_grad():
        jvpreg.jvp(model, (x.float(),), (u.float(),))  # grad mode
    assert len(capture.programs(model)) == 5
    jvpreg.jvp(model, (x.float(),), (torch.randn(2, 3, 4),), batched_tangents=True)  # number of tangents
    assert len(capture.programs(model)) == 6


@pytest.mark.slow
def test_past_max_programs_a_signature_runs_eagerly_with_one_warning_that_names_varying_sizes():
    """Sequence lengths that change from batch to batch (dynamic padding) are one signature each: past
    ``MAX_PROGRAMS`` a new one runs in eager clone mode, exact, after one warning that says to pad to a few lengths."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(D)
    with count_captures() as counts:
        for n in range(1, capture.MAX_PROGRAMS + 1):
            jvpreg.jvp(model, (randn(n, 4),), (randn(n, 4),))
    assert counts.recorded == capture.MAX_PROGRAMS == len(capture.programs(model))
    counts.ran_programs(capture.MAX_PROGRAMS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (capture.MAX_PROGRAMS + 1, capture.MAX_PROGRAMS + 2):
            x, u = randn(n, 4), randn(n, 4)
            y, t = jvpreg.jvp(model, (x,), (u,))
            ref_y, ref_t = torch.func.jvp(model, (x,), (u,))
            torch.testing.assert_close((y, t), (ref_y, ref_t), rtol=1e-12, atol=1e-12)
    messages = [str(w.message) for w in caught if issubclass(w.category, JVPCaptureWarning)]
    assert len(messages) == 1 and "pad_to_multiple_of" in messages[0], messages
    assert capture.programs(model)[next(reversed(capture.programs(model)))].gm is None


def test_the_padding_hint_needs_sizes_that_vary():
    key = lambda *shapes: (None, None, tuple(("tensor", s, D, None, False, True) for s in shapes))  # noqa: E731
    assert capture._varying_sizes([key((2, 4)), key((2, 4))]) == ""
    assert "pad_to_multiple_of" in capture._varying_sizes([key((2, 4)), key((2, 5))])


class _ShiftedByAFactoryTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + torch.full((4,), 1 / 3)  # the default dtype: float64 promotes the output


@pytest.mark.slow
def test_a_changed_default_dtype_recaptures():
    """Factory ops without a dtype follow ``torch.set_default_dtype``; before, a program recorded under float32
    replayed its float32 promotion after the default became float64 (6e-8 off the eager call's output)."""
    model = _ShiftedByAFactoryTensor()
    x, u = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(2):
        jvpreg.jvp(model, (x,), (u,), engine="captured")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        y, t = jvpreg.jvp(model, (x,), (u,), engine="captured")
        y_e, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    finally:
        torch.set_default_dtype(previous)
    assert y.dtype == y_e.dtype == torch.float64 and len(capture.programs(model)) == 2
    torch.testing.assert_close(y, y_e, rtol=0, atol=0)
    torch.testing.assert_close(t, t_e, rtol=0, atol=0)


def test_auto_runs_a_new_signature_eagerly_once_then_captures(monkeypatch):
    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", DEFAULT_EAGER_CALLS)
    assert DEFAULT_EAGER_CALLS == 1
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    x, u = randn(3, 4), randn(3, 4)
    _, t_ref = jvpreg.jvp(model, (x,), (u,), engine="eager")
    _, t1 = jvpreg.jvp(model, (x,), (u,))
    assert capture.programs(model) == {}  # a first call: eager clone mode, nothing recorded
    _, t2 = jvpreg.jvp(model, (x,), (u,))
    (prog,) = capture.programs(model).values()  # the second call of the signature captures
    _, t3 = jvpreg.jvp(model, (x,), (u,))
    assert list(capture.programs(model).values()) == [prog]
    for t in (t1, t2, t3):
        torch.testing.assert_close(t, t_ref, rtol=0, atol=0)
    jvpreg.jvp(model, (randn(5, 4),), (randn(5, 4),))  # a signature seen once (a last partial batch)
    assert len(capture.programs(model)) == 1
    other = copy.deepcopy(model)
    jvpreg.jvp(other, (x,), (u,), engine="captured")  # asked for: captured on the first call
    assert len(capture.programs(other)) == 1


def test_auto_warns_about_an_uncapturable_model_when_it_would_capture(monkeypatch):
    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", DEFAULT_EAGER_CALLS)
    capture._WARNED.clear()
    model = Branchy().to(D)
    x, u = randn(3, 4), randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jvpreg.jvp(model, (x,), (u,))
    with pytest.warns(JVPCaptureWarning, match="draws at random"):
        _, t = jvpreg.jvp(model, (x,), (u,))
    _, t_ref = jvpreg.jvp(model, (x,), (u,), engine="eager")
    torch.testing.assert_close(t, t_ref, rtol=0, atol=0)


def test_replaced_parameter_and_swapped_submodule_are_used():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).to(D)
    x, u = randn(3, 4), randn(3, 4)
    jvpreg.jvp(model, (x,), (u,))
    model[0].weight = nn.Parameter(randn(4, 4))
    model[1] = nn.Tanh()
    _, t = jvpreg.jvp(model, (x,), (u,))
    _, t_ref = torch.func.jvp(model, (x,), (u,))
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)


def test_inplace_parameter_update_is_seen_by_the_replay():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).to(D)
    x, u = randn(3, 4), randn(3, 4)
    jvpreg.jvp(model, (x,), (u,))
    with torch.no_grad():
        model[2].weight.mul_(3.0)  # an optimizer step
    _, t = jvpreg.jvp(model, (x,), (u,))
    _, t_ref = torch.func.jvp(model, (x,), (u,))
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_value_dependent_control_flow_falls_back_to_eager_with_one_warning(sign):
    capture._WARNED.clear()
    torch.manual_seed(0)
    model = Branchy().to(D)
    x, u = randn(3, 4), randn(3, 4)
    with torch.no_grad():
        model.lin.bias.fill_(10.0 * sign)
    with pytest.warns(JVPCaptureWarning, match="draws at random"):
        _, t = jvpreg.jvp(model, (x,), (u,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", JVPCaptureWarning)
        _, t2 = jvpreg.jvp(model, (x,), (u,))  # warned once
    _, t_ref = torch.func.jvp(model, (x,), (u,))
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t2, t_ref, rtol=1e-10, atol=1e-12)


def test_forward_hooks_and_custom_functions_fall_back_to_eager():
    capture._WARNED.clear()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to(D)
    seen = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(out.shape))
    x, u = randn(3, 4), randn(3, 4)
    with pytest.warns(JVPCaptureWarning, match="forward hooks on Linear"):
        jvpreg.jvp(model, (x,), (u,))
    jvpreg.jvp(model, (x,), (u,))
    assert len(seen) == 2  # the hook ran on every call

    capture._WARNED.clear()
    model = WithFunction().to(D)
    with pytest.warns(JVPCaptureWarning, match="custom autograd.Function Straight"):
        _, t = jvpreg.jvp(model, (x,), (u,))
    _, t_ref = jvpreg.jvp(model, (x,), (u,), engine="eager")
    torch.testing.assert_close(t, t_ref, rtol=0, atol=0)


def test_forward_hook_registered_after_a_capture_runs_and_its_removal_is_exact():
    """A hook registered after the program was recorded must change the answer (it did not: the replay
    skipped it); after its removal the answers are the plain ones again."""
    capture._WARNED.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    x, u = randn(3, 4), randn(3, 4)
    _, t_plain = jvpreg.jvp(model, (x,), (u,))
    handle = model[1].register_forward_hook(lambda m, a, out: 2 * out)
    with pytest.warns(JVPCaptureWarning, match="forward hooks on Tanh"):
        y, t = jvpreg.jvp(model, (x,), (u,))
    y_ref, t_ref = torch.func.jvp(model, (x,), (u,))
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)
    handle.remove()
    _, t_after = jvpreg.jvp(model, (x,), (u,))
    torch.testing.assert_close(t_after, t_plain, rtol=1e-12, atol=1e-12)


def test_training_flags_guarded_except_on_stateless_torch_leaves():
    """Dropout, BatchNorm and user modules have their train/eval flag guarded; Linear and ReLU (whose forward
    reads neither the flag nor submodules) are not walked on every call."""
    class User(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * (2.0 if self.training else 1.0)

    class SubLinear(nn.Linear):  # a subclass may read the flag in a method the inherited forward calls
        pass

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Dropout(0.5), nn.BatchNorm1d(4), User(),
                          SubLinear(4, 4)).to(D).train()
    x, u = randn(3, 4), randn(3, 4)
    jvpreg.jvp(model, (x,), (u,))
    rec = capture._RECORDS[model]
    flagged = {type(m) for m in rec.flagged} | ({type(model)} if rec.root_flagged else set())  # root: held weakly
    assert flagged == {nn.Sequential, nn.Dropout, nn.BatchNorm1d, User, SubLinear}
    model[4].eval()  # only the user module: recaptures, and the flag's branch is taken
    model[2].eval()
    with torch.no_grad():
        _, t = jvpreg.jvp(model, (x,), (u,))
    _, t_ref = jvpreg.jvp(model, (x,), (u,), engine="eager")
    torch.testing.assert_close(t, t_ref, rtol=0, atol=0)
    assert len(capture.programs(model)) == 2


def test_op_without_rule_falls_back_to_eager_with_the_exact_fallback():
    capture._WARNED.clear()

    class Atan(nn.Module):
        def forward(self, x):
            return torch.atan(x) * 2

    model = Atan()
    x, u = randn(3, 4), randn(3, 4)
    with pytest.warns(JVPCaptureWarning, match="torch.atan has no clone rule"):
        _, t = jvpreg.jvp(model, (x,), (u,))
    _, t_ref = torch.func.jvp(model, (x,), (u,))
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)


def test_dropout_one_mask_for_all_blocks_and_fresh_masks_per_call():
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 3)).to(D).train()
    x, u = randn(4, 6), randn(4, 6)
    torch.manual_seed(3)
    y_c, t_c = jvpreg.jvp(model, (x,), (u,))  # the capture restores the RNG: the replay draws as eager would
    torch.manual_seed(3)
    y_e, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
    torch.testing.assert_close(t_c, t_e, rtol=0, atol=0)
    y2, _ = jvpreg.jvp(model, (x,), (u,))
    assert not torch.equal(y2, y_c)  # a new mask on the next call


class _SeededDropout(nn.Module):
    """Dropout under a seed of its own, as OpInfo's ``wrapper_set_seed`` runs its random ops: Python that a
    captured program does not replay."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.lin = how, nn.Linear(6, 8)

    def forward(self, x):
        h = self.lin(x)
        if self.how == "fork_rng":  # the generators come back as they were: the draws leave no trace in the state
            with torch.random.fork_rng():
                torch.manual_seed(42)
                return torch.nn.functional.dropout(h, 0.5)
        torch.manual_seed(42)
        return torch.nn.functional.dropout(h, 0.5)


@pytest.mark.parametrize("engine", ["captured", "compiled"])
@pytest.mark.parametrize("how, caller_seed", [("fork_rng", 3), ("manual_seed", 3), ("manual_seed", 42)])
def test_forward_that_seeds_the_generator_runs_eagerly_with_the_same_masks(how, caller_seed, engine):
    """A program replays the random ops, not Python's seeding: the capture runs it once and compares the generators'
    states; the forward then runs in eager clone mode (same masks, same generator state after the call as eager),
    where a replay drew other masks (OpInfo's SDPA with dropout: wrong primal by the captured sweep). Caller seed 42
    is the state the forward seeds: a trace and a replay from it would end alike (the trace starts one draw on).
    A program to be compiled is checked the same way (it is the same recorded program)."""
    capture._WARNED.clear()
    model = _SeededDropout(how).to(D)
    x, u = randn(4, 6), randn(4, 6)
    torch.manual_seed(caller_seed)
    y_e, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    after_eager = torch.get_rng_state()
    torch.manual_seed(caller_seed)
    with pytest.warns(JVPCaptureWarning, match="seeds or sets a random number generator"):
        y_c, t_c = jvpreg.jvp(model, (x,), (u,), engine=engine)
    assert torch.equal(torch.get_rng_state(), after_eager)
    torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
    torch.testing.assert_close(t_c, t_e, rtol=0, atol=0)
    assert all(p.gm is None for p in capture.programs(model).values())


class _GeneratorNoise(nn.Module):
    """Noise drawn from an explicit ``torch.Generator``: the model's own, kept across calls (``own``) or seeded again
    in every forward (``reseeded``), or one made in the forward (``made_in_forward``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.lin, self.gen = how, nn.Linear(6, 8), torch.Generator().manual_seed(7)

    def forward(self, x):
        gen = self.gen
        if self.how == "reseeded":
            gen.manual_seed(7)
        elif self.how == "made_in_forward":
            gen = torch.Generator().manual_seed(7)
        return torch.relu(self.lin(x)) + torch.randn(x.shape[0], 8, dtype=x.dtype, generator=gen)


def _tracer_records_generators() -> bool:
    from torch.fx.experimental.proxy_tensor import make_fx

    gen = torch.Generator()
    try:
        make_fx(lambda x: x + torch.randn(2, generator=gen), tracing_mode="real", pre_dispatch=True)(torch.zeros(2))
    except NotImplementedError:
        return False
    return True


@pytest.mark.parametrize("how, reason", [("own", None), ("reseeded", "seeds or sets a random number generator"),
                                         ("made_in_forward", "not an attribute of the model")])
def test_noise_from_an_explicit_generator_is_drawn_as_in_eager_mode(how, reason):
    """A program holds the generator its random op names. The model's own generator is restored after the trace and
    checked like the default ones, so a program that draws from it as the forward does is kept; one seeded in the
    forward (here from the first call, whose state is the seed's) or made there runs in eager clone mode. Before, both
    replayed other noise on every call after the capture (a wrong primal, silently)."""
    if not _tracer_records_generators():  # torch 2.11: every case runs eagerly, with the tracer's reason
        reason = "the tracer cannot record it"
    capture._WARNED.clear()
    torch.manual_seed(0)
    model, eager = _GeneratorNoise(how).to(D), _GeneratorNoise(how).to(D)
    eager.load_state_dict(model.state_dict())
    x, u = randn(4, 6), randn(4, 6)
    for call in range(3):
        y_e, t_e = jvpreg.jvp(eager, (x,), (u,), engine="eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y_c, t_c = jvpreg.jvp(model, (x,), (u,), engine="captured")
        said = [str(w.message) for w in caught if issubclass(w.category, JVPCaptureWarning)]
        if call == 0 and reason is not None:
            assert len(said) == 1 and reason in said[0], said
        else:
            assert said == []
        torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
        torch.testing.assert_close(t_c, t_e, rtol=0, atol=0)
        assert torch.equal(model.gen.get_state(), eager.gen.get_state())
    assert [p.gm is not None for p in capture.programs(model).values()] == [reason is None]


@pytest.mark.slow
def test_dropout_program_is_checked_once_and_kept():
    """The generator check at capture keeps a plain dropout forward captured, and leaves the caller's generator where
    an eager call leaves it."""
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 3)).to(D).train()
    x, u = randn(4, 6), randn(4, 6)
    torch.manual_seed(5)
    y_e, _ = jvpreg.jvp(model, (x,), (u,), engine="eager")
    after_eager = torch.get_rng_state()
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", JVPCaptureWarning)
        y_c, _ = jvpreg.jvp(model, (x,), (u,), engine="captured")
    assert torch.equal(torch.get_rng_state(), after_eager)
    torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
    assert [p.gm is not None for p in capture.programs(model).values()] == [True]


def test_a_program_that_fails_its_random_draw_check_runs_eagerly(monkeypatch):
    """The check's replay raising (here: a replay function that always raises) is a capture failure: eager clone mode
    with one warning, never an exception from the capture."""
    capture._WARNED.clear()
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 3)).to(D).train()
    x, u = randn(4, 6), randn(4, 6)

    def broken(gm):
        def run(*args):
            raise RuntimeError("replay failed")
        return run

    monkeypatch.setattr(capture, "replay_function", broken)
    torch.manual_seed(5)
    y_e, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    torch.manual_seed(5)
    with pytest.warns(JVPCaptureWarning, match="replayed once to check its random draws, raised RuntimeError"):
        y_c, t_c = jvpreg.jvp(model, (x,), (u,), engine="captured")
    torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
    torch.testing.assert_close(t_c, t_e, rtol=0, atol=0)


def test_jvp_params_captured_equals_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2)).to(D)
    x = randn(3, 2, 4, 4)
    dirs = {"0.weight": randn(2, 3, 2, 3, 3), "4.bias": randn(2, 2)}
    eager = copy.deepcopy(model)
    for _ in range(2):
        with count_captures() as n:
            y, t = jvpreg.jvp_params(model, (x,), dirs, batched_tangents=True)
        n.ran_programs(1)
        y_e, t_e = jvpreg.jvp_params(eager, (x,), dirs, batched_tangents=True, engine="eager")
        torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)
    assert len(capture.programs(model)) == 1


def test_clone_put_into_a_slot_by_hand_runs_eagerly_and_exactly():
    """The captured engine learns of clone parameters from swap_in (it does not read every slot's tensor on
    every call); a clone written into ``_parameters`` by hand is caught at capture and runs eagerly."""
    capture._WARNED.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh()).to(D)
    x, dw = randn(2, 4), randn(3, 4)
    (xc, wc), s = jvpreg.clone.pack((x, model[0].weight), (torch.zeros(1, 2, 4, dtype=D), dw[None]))
    weight = model[0]._parameters["weight"]
    model[0]._parameters["weight"] = wc
    try:
        with pytest.warns(JVPCaptureWarning, match="did not put there"):
            out = jvpreg.clone.call(model, (xc,), engine="captured")
        _, t = jvpreg.clone.unpack(out, s, batched=False)
    finally:
        model[0]._parameters["weight"] = weight
    _, t_ref = jvpreg.jvp_params(model, (x,), {"0.weight": dw})
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)


def test_stacked_penalties_captured_equal_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(48, 3)).to(D).train()
    x = randn(4, 1, 4, 4)

    def run(engine):
        m = copy.deepcopy(model)
        stack = Stack([JacobianFrobenius(n_projections=2, seed=0), TangentProp(transforms=("translate_x",))],
                      weights=[1.0, 0.5])
        for _ in range(2):
            m.zero_grad()
            out, pen = stack(m, x, engine=engine)
            (out.sum() + pen).backward()
        return out, pen, [p.grad for p in m.parameters()]

    out, pen, grads = run("auto")
    out_e, pen_e, grads_e = run("eager")
    torch.testing.assert_close(pen, pen_e, rtol=1e-12, atol=1e-12)
    for g, g_e in zip(grads, grads_e):
        torch.testing.assert_close(g, g_e, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_compiled_module_runs_its_original_code_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(D)
    compiled = torch.compile(model, backend="eager")
    x, u = randn(3, 4), randn(3, 4)
    _, t_ref = torch.func.jvp(model, (x,), (u,))
    for engine in ("eager", "captured"):
        _, t = jvpreg.jvp(compiled, (x,), (u,), engine=engine)
        torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)
    # a compiled submodule inside a plain module
    outer = nn.Sequential(torch.compile(nn.Linear(4, 4).to(D), backend="eager"), nn.Tanh())
    _, t = jvpreg.jvp(outer, (x,), (u,))
    _, t_ref = torch.func.jvp(nn.Sequential(outer[0]._orig_mod, outer[1]), (x,), (u,))
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)
    out, pen = regularized_forward(compiled, x, JacobianFrobenius(seed=0))
    assert torch.isfinite(pen)


@pytest.mark.slow
def test_module_compiled_in_place_runs_its_original_code_exactly():
    """``module.compile()`` (the module keeps its class and state_dict keys; its __call__ runs a compiled
    _call_impl): every engine clones the original code, "auto" picks the compiled engine, and the module is still
    compiled afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2)).to(D)
    x, u = randn(3, 4), randn(3, 4)
    _, t_ref = torch.func.jvp(model, (x,), (u,))
    model.compile(backend="eager")
    model[2].compile(backend="eager")  # a submodule compiled in place too
    assert capture.resolve_engine("auto", model, "test") == "compiled"
    for engine in ("eager", "captured", "auto"):
        _, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
        torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)
    assert capture.compiled_in_place(model) and capture.compiled_in_place(model[2])
    out, pen = regularized_forward(model, x, JacobianFrobenius(seed=0))
    assert torch.isfinite(pen) and capture.compiled_in_place(model)


@pytest.mark.slow
def test_compiled_engine_records_its_own_program_for_recurrent_layers():
    """The LSTM rule picks its fewest-ops form (torch's fused kernel for the primal, the tangent step by step)
    for a replay and the per-step form (one kernel chain Inductor fuses) for engine='compiled': two programs,
    the same JVP."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(3, 4)

        def forward(self, x):
            return self.lstm(x)[0]

    model = Net().to(D)
    x, u = randn(4, 2, 3), randn(4, 2, 3)
    _, t = jvpreg.jvp(model, (x,), (u,), engine="captured")
    _, tc = jvpreg.jvp(model, (x,), (u,), engine="compiled")
    _, ref = torch.func.jvp(model, (x,), (u,))
    torch.testing.assert_close(t, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tc, ref, rtol=1e-10, atol=1e-12)
    lstm_ops = [sum(n.target is torch.ops.aten.lstm.input for n in p.gm.graph.nodes)
                for p in capture.programs(model).values()]
    assert sorted(lstm_ops) == [0, 1]


def _compiled_and_captured_agree(model, x, u, loss, calls=2):
    """Two calls of ``jvpreg.jvp`` with engine='compiled' on ``model`` and 'captured' on a copy: the same JVP and
    the same parameter gradients of ``loss(y, t)``; returns the copy (its buffers for the caller to compare)."""
    twin = copy.deepcopy(model)
    for _ in range(calls):
        model.zero_grad(), twin.zero_grad()
        y, t = jvpreg.jvp(model, (x,), (u,), engine="compiled")
        y2, t2 = jvpreg.jvp(twin, (x,), (u,), engine="captured")
        torch.testing.assert_close(t, t2, rtol=1e-10, atol=1e-12)
        loss(y, t).backward()
        loss(y2, t2).backward()
        for p, p2 in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, p2.grad, rtol=1e-10, atol=1e-12)
    return twin


@pytest.mark.slow
def test_compiled_engine_equals_captured():
    """engine='compiled': the captured program under torch.compile (Inductor) gives the same JVP and gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2)).to(D)
    _compiled_and_captured_agree(model, randn(5, 6), randn(5, 6), lambda y, t: t.pow(2).sum())


@pytest.mark.slow
def test_compiled_engine_calls_jvpregs_operators_under_autograd():
    """Under autograd a program compiled for the CPU calls jvpreg's operators (relu pattern as bools, on blocks of
    any size; BatchNorm and LayerNorm tangents with written-out backwards) as opaque kernels: same JVP, gradients
    and running statistics as the captured engine, compiled without Inductor's layout optimisation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).to(D).train()
    m2 = _compiled_and_captured_agree(model, randn(5, 3, 6, 6), randn(5, 3, 6, 6),
                                      lambda y, t: t.pow(2).sum() + y.sum())
    for b, b2 in zip(model.buffers(), m2.buffers()):  # Inductor's own reduction order: equal up to rounding
        torch.testing.assert_close(b, b2, rtol=1e-13, atol=1e-15)
    prog = next(p for p in capture.programs(model).values() if p.compiled is not None)
    ops = {str(n.target) for n in prog.gm.graph.nodes if str(n.target).startswith("jvpreg.")}
    assert {"jvpreg.relu_blocks.default", "jvpreg.batch_norm_tangent.default",
            "jvpreg.layer_norm_tangent.default"} <= ops, ops
    assert capture.inductor_options("cpu") == {"layout_optimization": False}


def test_engine_argument_is_validated():
    with pytest.raises(ValueError, match=r"jvpreg.jvp\(func, primals, tangents\): expected engine to be one of"):
        jvpreg.jvp(nn.Linear(2, 2), (torch.randn(1, 2),), (torch.randn(1, 2),), engine="fast")


def test_plain_functions_default_to_eager_and_can_be_captured_only_as_modules():
    x, u = randn(3, 4), randn(3, 4)
    with fallback_mode("error"):
        _, t = jvpreg.jvp(lambda z: torch.relu(z) * 2, (x,), (u,))
    torch.testing.assert_close(t, torch.where(x > 0, 2 * u, torch.zeros_like(u)))


def test_gradient_hook_in_forward_falls_back_to_eager_and_fires():
    capture._WARNED.clear()
    seen = []

    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            h.register_hook(lambda g: seen.append(g.shape))
            return torch.tanh(h)

    model = Hooked().to(D)
    x, u = randn(3, 4), randn(3, 4)
    with pytest.warns(JVPCaptureWarning, match="gradient hook"):
        _, t = jvpreg.jvp(model, (x,), (u,))
    t.sum().backward()
    assert seen  # the hook fired


def test_grad_mode_switches_inside_the_forward_are_replayed():
    """A no_grad region inside the forward stays a no_grad region in the replay (same gradients)."""

    class Centered(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            with torch.no_grad():
                m = h.mean()
            return torch.tanh(h - m)

    torch.manual_seed(0)
    model = Centered().to(D)
    x, u = randn(3, 4), randn(3, 4)
    grads = []
    for engine in ("captured", "captured", "eager"):
        model.zero_grad()
        y, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
        (t.pow(2).sum() + y.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g_c, g_e in zip(grads[1], grads[2]):
        torch.testing.assert_close(g_c, g_e, rtol=1e-12, atol=1e-12)


def test_reassigned_tensor_attribute_recaptures():
    """A plain tensor attribute baked into the program as a constant: reassigning it recaptures."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.scale = torch.tensor(2.0, dtype=D)

        def forward(self, x):
            return torch.tanh(self.lin(x)) * self.scale

    model = Scaled().to(D)
    x, u = randn(2, 3), randn(2, 3)
    jvpreg.jvp(model, (x,), (u,))
    model.scale = torch.tensor(3.0, dtype=D)
    _, t = jvpreg.jvp(model, (x,), (u,))
    _, t_ref = torch.func.jvp(model, (x,), (u,))
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)


def test_an_alias_the_tracer_cannot_see_is_refused_not_baked_as_a_constant(monkeypatch):
    """A rule that aliases a traced tensor where the tracer cannot see it (``as_subclass`` of a plain tensor) would
    replay the capturing call's values forever: the capture refuses it and eager clone mode runs (exact)."""
    from torch._C import DisableTorchFunctionSubclass

    import jvpreg.clone.rules.batch_norm as norm

    def invisible_alias(t):
        with DisableTorchFunctionSubclass():
            return t.as_subclass(torch.Tensor)

    monkeypatch.setattr(norm, "raw", invisible_alias)
    monkeypatch.setattr(norm, "_blocks_in_one_output", lambda *args: False)  # the composite rule, where raw(d) is
    torch.manual_seed(0)                                                       # made from traced ops
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7)).to(D).train()
    x, u = randn(6, 5), randn(6, 5)
    with pytest.warns(capture.JVPCaptureWarning, match="shares memory with a tensor of the traced call"):
        jvpreg.jvp(model, (x,), (u,), engine="captured")
    x2, u2 = randn(6, 5), randn(6, 5)
    _, t = jvpreg.jvp(model, (x2,), (u2,), engine="captured")
    _, want = jvpreg.jvp(model, (x2,), (u2,), engine="eager")
    torch.testing.assert_close(t, want, rtol=1e-12, atol=1e-12)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.tensor(2.0, dtype=D)  # a plain tensor attribute the program bakes in

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.scale


@pytest.mark.parametrize("engine", ["captured", "compiled"])
@pytest.mark.slow
def test_a_captured_module_is_freed_with_its_programs_when_the_caller_drops_it(engine):
    """The records live in a weak-keyed dict: a record that held its module strongly kept every module ever
    captured (and its programs) alive for the life of the process."""
    import gc
    import weakref

    refs = []
    for _ in range(3):
        m = _Scaled().to(D)
        x = torch.randn(2, 4, dtype=D)
        jvpreg.jvp(m, (x,), (torch.randn_like(x),), engine=engine)
        assert capture.programs(m)
        refs.append(weakref.ref(m))
        del m
    gc.collect()
    assert [r() for r in refs] == [None] * 3


def test_the_capture_counts_see_an_eager_run_as_no_program():
    """The tests' proof that a program ran (``conftest.count_captures``) tells the engines apart: the same module
    and numbers, captured then replayed, then in eager clone mode (which an ``all(... gm is not None)`` over an
    empty ``capture.programs`` could not tell from a replay)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(D)
    x, u = randn(3, 4), randn(3, 4)
    with count_captures() as captured:
        for _ in range(2):
            jvpreg.jvp(model, (x,), (u,), engine="captured")
    assert captured.recorded == 1 and captured.refused == 0
    captured.ran_programs(2)
    with count_captures() as eager:
        jvpreg.jvp(copy.deepcopy(model), (x,), (u,), engine="eager")
    assert eager == type(eager)()
    with pytest.raises(AssertionError, match="expected 1 replays and no eager run"):
        eager.ran_programs(1)


def test_runs_engine_fails_where_a_function_named_captured_runs_eagerly(monkeypatch):
    """``conftest.runs_engine`` (the tests' proof that the engine they name ran, issue 56): a lambda captured and
    replayed passes; the same lambda run eagerly, because ``callables.take_apart`` refuses every callable (a
    mutation of the engine) or because the engine is forced to eager in ``capture._call``, fails it, and passes
    only as a refusal with the reason it gives, said by a ``JVPCaptureWarning``."""
    from conftest import runs_engine

    from jvpreg.clone import callables

    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", DEFAULT_EAGER_CALLS)  # auto: eager, then programs
    w = randn(4, 4)
    f = lambda x: torch.tanh(x @ w)  # noqa: E731
    x, u = randn(3, 4), randn(3, 4)

    def calls(engine, n=2):
        for _ in range(n):
            jvpreg.jvp(f, (x,), (u,), engine=engine)

    with runs_engine("captured", calls=2):
        calls("captured")
    with runs_engine("auto", calls=3):
        calls("auto", 3)
    with runs_engine("eager", calls=2):
        calls("eager")
    with monkeypatch.context() as patch:
        patch.setattr(callables, "take_apart", lambda fn: callables.Parts(reason="a mutation refuses it"))
        for engine in ("captured", "auto"):
            with pytest.raises(AssertionError, match="not taken apart|expected"):
                with runs_engine(engine, calls=2):
                    calls(engine)
        with runs_engine("captured", calls=2, refused="a mutation refuses it"):
            calls("captured")
    with monkeypatch.context() as patch:
        real = capture._call
        patch.setattr(capture, "_call", lambda module, args, kwargs, engine, *rest: real(module, args, kwargs,
                                                                                         "eager", *rest))
        with pytest.raises(AssertionError, match="expected 2 replays and no eager run"):
            with runs_engine("captured", calls=2):
                calls("captured")
