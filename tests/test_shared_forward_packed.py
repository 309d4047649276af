"""The shared forward packs its input inside the captured program (``jvpreg.clone.api.packed_call``).

Where only the input carries directions, no other hook sees the module's call and no argument is a container,
:class:`jvpreg.callbacks.SharedForward` records ``(args, u, s) -> (f(x), J u, s)`` as one program, as
``jvpreg.jvp`` does; so does ``regularized_forward`` (and every penalty module's call). Reference: the same step on the eager engine (op by op, packing outside), in float64:
penalties, parameter gradients and BatchNorm running statistics.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jvpreg.callbacks import SharedForward
from jvpreg.clone import api
from jvpreg.clone.program import capture
from jvpreg.clone.core.device_paths import accelerator_path
from jvpreg.losses import JacobianFrobenius, regularized_forward

D = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def cnn_bn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(48, 16), nn.Tanh(), nn.Linear(16, 3))


class Masked(nn.Module):
    """A forward with a keyword argument besides its input (an attention-mask-like tensor and a flag)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x, *, mask=None, scale=1.0):
        h = torch.relu(self.a(x)) * scale
        return self.b(h if mask is None else h * mask)


class WithList(nn.Module):
    """A forward handed a list it writes into (an auxiliary loss): its writes must reach the caller's list."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 2)

    def forward(self, x, aux):
        y = self.a(x)
        aux.append(y.pow(2).mean())
        return y


def penalties():
    return [(JacobianFrobenius(2, seed=0), 0.5, 1.0), (JacobianFrobenius(1, seed=1), 0.25, 0.5)]


def step(model, shared, x, call=None):
    """One regularized step's loss, its parameter gradients, and whether the call packed inside a program."""
    shared.arm(penalties())
    try:
        out = call(model, x) if call is not None else model(x)
        packed = shared.plan.x_in is None
        loss = out.pow(2).sum() + shared.total()
    finally:
        shared.disarm()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    return out.detach(), loss.detach(), grads, packed


def run(model, x, engine, steps=3, call=None, context=contextlib.nullcontext):
    """``steps`` regularized steps (the default engine records on the second, replays on the third)."""
    model = copy.deepcopy(model)
    shared = SharedForward(model, engine=engine)
    results = []
    for _ in range(steps):
        with context():
            results.append(step(model, shared, x, call))
    shared.remove()
    return model, results


def _packed_programs(model) -> list:
    return [k for k in capture.programs(model) if isinstance(k[0], tuple) and k[0][0] == "packed"]


def assert_same(results, reference, rtol=1e-12):
    for (out, loss, grads, _), (out_r, loss_r, grads_r, _) in zip(results, reference):
        torch.testing.assert_close(out, out_r, rtol=rtol, atol=0)
        torch.testing.assert_close(loss, loss_r, rtol=rtol, atol=0)
        for g, g_r in zip(grads, grads_r):
            torch.testing.assert_close(g, g_r, rtol=rtol, atol=1e-14)


@pytest.mark.parametrize("engine", ["auto", "captured"])
def test_packed_step_gives_the_eager_penalty_gradients_and_running_statistics(engine):
    torch.manual_seed(0)
    net = cnn_bn().to(D).train()
    x = torch.randn(8, 1, 4, 4, dtype=D)
    model, results = run(net, x, engine)
    model_e, reference = run(net, x, "eager")
    assert all(r[3] for r in results) and not any(r[3] for r in reference)
    assert_same(results, reference)
    for name, buf in model_e.named_buffers():  # updated once per step from the primal rows, as eagerly
        assert torch.equal(dict(model.named_buffers())[name], buf), name
    progs = _packed_programs(model)
    assert len(progs) == 1 and capture.programs(model)[progs[0]].replays >= 1


def test_packed_step_with_keyword_arguments():
    torch.manual_seed(0)
    net = Masked().to(D)
    x, mask = torch.randn(5, 6, dtype=D), (torch.rand(5, 8) > 0.3).to(D)
    call = lambda m, z: m(z, mask=mask, scale=0.5)  # noqa: E731
    model, results = run(net, x, "captured", call=call)
    _, reference = run(net, x, "eager", call=call)
    assert all(r[3] for r in results)
    assert_same(results, reference)


def test_packed_step_matches_the_reference_jacobian():
    """The penalty itself against an explicit Jacobian: ||J u||^2 with the penalty's own directions."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).to(D)
    x = torch.randn(4, 5, dtype=D)
    shared = SharedForward(net, engine="captured")
    pen = JacobianFrobenius(1, seed=3)
    for _ in range(2):
        u = copy.deepcopy(pen).directions(x, None)  # the directions the armed copy draws
        shared.arm([(copy.deepcopy(pen), 1.0, 1.0)])
        net(x)
        assert shared.plan.x_in is None
        got = shared.total()
        shared.disarm()
        jac = torch.autograd.functional.jacobian(net, x)  # (4, 3, 4, 5)
        ju = torch.einsum("bcaf,af->bc", jac, u[0])
        want = copy.deepcopy(pen).penalty(ju[None], _Context(x))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


class _Context:
    def __init__(self, x):
        self.x, self.rows, self.output, self.target = x, x.shape[0], None, None


@pytest.mark.slow
def test_packed_step_on_the_accelerator_path_chooses_its_scales_inside_the_program():
    torch.manual_seed(0)
    net = cnn_bn().to(D).train()
    x = torch.randn(8, 1, 4, 4, dtype=D)
    model, results = run(net, x, "captured", context=accelerator_path)
    _, reference = run(net, x, "eager")
    assert all(r[3] for r in results)
    assert_same(results, reference, rtol=1e-10)
    shared = SharedForward(model, engine="captured")  # the program's scales: the host's choice, bit for bit
    for _ in range(2):
        shared.arm(penalties())
        with accelerator_path():
            model(x)
        plan = shared.plan
        shared.disarm()
        assert plan.x_in is None and plan.scales.shape == (3,)
        assert torch.equal(plan.scales, api.scales([(x, plan.u)], 3)), (plan.scales, api.scales([(x, plan.u)], 3))


@pytest.mark.parametrize("obstacle", ["forward hook", "backward hook", "list argument", "eager engine"])
def test_calls_the_program_cannot_pack_take_the_clone_batch(obstacle):
    """Another hook on the module would see the clone batch, a container argument would be rebuilt inside the
    program (the forward's writes into it lost): such calls pack outside, as before, with the same numbers."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, dtype=D)
    net = WithList().to(D) if obstacle == "list argument" else nn.Sequential(nn.Linear(6, 4), nn.Tanh(),
                                                                               nn.Linear(4, 2)).to(D)
    seen = []
    if obstacle == "forward hook":
        net.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    elif obstacle == "backward hook":
        net.register_full_backward_hook(lambda m, gi, go: None)
    aux_lists = []

    def call(m, z):
        if obstacle != "list argument":
            return m(z)
        aux = []
        aux_lists.append(aux)
        return m(z, aux)

    engine = "eager" if obstacle == "eager engine" else "captured"
    model, results = run(net, x, engine, call=call)
    _, reference = run(net, x, "eager", call=call)
    assert not any(r[3] for r in results) and not _packed_programs(model)
    assert_same(results, reference)
    if obstacle == "list argument":
        assert all(len(a) == 1 and a[0].shape == () for a in aux_lists)  # every call's write reached its list
    if obstacle == "forward hook":
        assert all(s == (4, 2) for s in seen)


@pytest.mark.slow
def test_an_input_passed_twice_packs_outside_the_program():
    """``model(x, x)``: only the regularized argument carries the directions (the pre-hook's choice), so the call
    packs outside the program, where the other argument stays plain; another tensor of the same values packs inside."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 2), nn.Linear(6, 2)

        def forward(self, x, ref):
            return torch.tanh(self.a(x)) + self.b(ref)

    torch.manual_seed(0)
    net, x = Two().to(D), torch.randn(4, 6, dtype=D)
    ref = x.clone()
    for other, packed in ((x, False), (ref, True)):
        call = lambda m, z: m(z, other)  # noqa: E731
        model, results = run(net, x, "captured", call=call)
        _, reference = run(net, x, "eager", call=call)
        assert all(r[3] == packed for r in results)
        assert_same(results, reference)


@pytest.mark.parametrize("engine", ["auto", "captured"])
def test_regularized_forward_packs_inside_the_program(engine):
    torch.manual_seed(0)
    net = cnn_bn().to(D).train()
    x = torch.randn(8, 1, 4, 4, dtype=D)
    got, want = copy.deepcopy(net), copy.deepcopy(net)
    for _ in range(3):
        out, pen = regularized_forward(got, x, [JacobianFrobenius(2, seed=0), JacobianFrobenius(seed=1)],
                                       engine=engine)
        out_e, pen_e = regularized_forward(want, x, [JacobianFrobenius(2, seed=0), JacobianFrobenius(seed=1)],
                                           engine="eager")
        torch.testing.assert_close(out, out_e, rtol=1e-12, atol=0)
        torch.testing.assert_close(pen, pen_e, rtol=1e-12, atol=0)
        grads = torch.autograd.grad(out.sum() + pen, list(got.parameters()))
        grads_e = torch.autograd.grad(out_e.sum() + pen_e, list(want.parameters()))
        for g, g_e in zip(grads, grads_e):
            torch.testing.assert_close(g, g_e, rtol=1e-12, atol=1e-14)
    for name, buf in want.named_buffers():
        assert torch.equal(dict(got.named_buffers())[name], buf), name
    assert _packed_programs(got) and all(k[0][0] == "packed" for k in capture.programs(got))


class AdditiveMask(nn.Module):
    """Attention-like scores with an additive mask argument (``-inf`` where masked), softmax over them."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(6, 5)

    def forward(self, x, mask):
        return torch.softmax(self.q(x) + mask, -1)


@pytest.mark.parametrize("entry", ["shared_forward", "regularized_forward"])
@pytest.mark.slow
def test_another_argument_turning_non_finite_after_the_capture_is_guarded(entry):
    """The norms of x and u say that they are finite; another argument (an additive mask of -inf) is checked by the
    guard as before: a program recorded for a finite mask is not replayed for one holding -inf (whose softmax
    needs the non-finite fix). Reference: torch.func.jvp of the same call, which the eager engine matches."""
    torch.manual_seed(0)
    net = AdditiveMask().to(D)
    x = torch.randn(4, 6, dtype=D)
    finite = torch.zeros(4, 5, dtype=D)
    masked = finite.clone()
    masked[:, 1] = float("-inf")
    pen = JacobianFrobenius(seed=0)
    shared = SharedForward(net, engine="captured")
    for mask in (finite, finite, masked, masked):
        u = copy.deepcopy(pen).directions(x, None)[0]
        want = (torch.func.jvp(lambda z: net(z, mask), (x,), (u,))[1]).pow(2).sum() / 4
        if entry == "shared_forward":
            shared.arm([(copy.deepcopy(pen), 1.0, 1.0)])
            net(x, mask)
            assert shared.plan.x_in is None
            got = shared.total()
            shared.disarm()
        else:
            got = regularized_forward(net, x, copy.deepcopy(pen), args=(mask,), engine="captured")[1]
        assert torch.isfinite(got)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
