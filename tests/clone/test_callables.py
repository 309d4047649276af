"""Callables as users pass them (``functools.partial`` of a module, lambdas and nested functions closing over modules
and tensors, bound methods, module globals) are captured: exact against ``torch.func.jvp`` in float64, one program
per structure, replayed on new closed-over values, recaptured where a guard changes; what cannot be taken apart
runs eagerly with one ``JVPCaptureWarning``."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import jvpreg
from jvpreg.clone import callables
from jvpreg.clone.program import capture

D = torch.float64


class Cond(nn.Module):
    """A mean-flow style model: ``u(z, t, r, y)`` with class conditioning and a guidance weight."""

    def __init__(self):
        super().__init__()
        self.inp, self.out, self.emb = nn.Linear(6, 8), nn.Linear(8, 6), nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, z, t, r, y=None, w=1.0):
        h = self.inp(z) * torch.sigmoid(t - r)[:, None] + self.emb(y) * w
        return self.out(torch.relu(self.norm(h)))

    def velocity(self, z, t, r, y):
        return self.forward(z, t, r, y=y)


def _data(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    z, v = torch.randn(b, 6, dtype=D, generator=g), torch.randn(b, 6, dtype=D, generator=g)
    t, r = torch.rand(b, dtype=D, generator=g), torch.rand(b, dtype=D, generator=g)
    y = torch.randint(0, 10, (b,), generator=g)
    return z, t, r, v, y


def _programs(module):
    return [p for p in capture.programs(module).values() if p.gm is not None]


def _check(f, primals, tangents, engine="auto"):
    got = jvpreg.jvp(f, primals, tangents, engine=engine)
    ref = torch.func.jvp(f, primals, tangents)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)


GLOBAL_NET = None


def _forms(net):
    def nested(z, t, r, y):
        def inner(a):
            return net(a, t, r, y=y)
        return inner(z)

    global GLOBAL_NET
    GLOBAL_NET = net
    return {
        "partial_keywords": lambda y: functools.partial(net, y=y, w=0.5),
        "partial_positional": lambda y: functools.partial(Cond.forward, net),
        "lambda": lambda y: (lambda z, t, r: net(z, t, r, y=y)),
        "nested": lambda y: (lambda z, t, r: nested(z, t, r, y)),
        "bound_method": lambda y: (lambda z, t, r: net.velocity(z, t, r, y)),
        "global_model": lambda y: (lambda z, t, r: GLOBAL_NET(z, t, r, y=y)),
    }


@pytest.mark.parametrize("form", list(_forms(Cond())))
def test_a_callable_made_anew_each_step_is_captured_once_and_replayed_exactly(form):
    torch.manual_seed(0)
    net = Cond().double()
    make = _forms(net)[form]
    for step in range(4):  # new conditioning, new callable at every step (a training loop)
        z, t, r, v, y = _data(seed=step)
        f = make(y)
        if form == "partial_positional":
            f = functools.partial(f, y=y)
        _check(f, (z, t, r), (v, torch.ones_like(t), torch.zeros_like(r)))
    progs = _programs(net)
    assert len(progs) == 1, [p.reason for p in capture.programs(net).values()]
    assert progs[0].replays == 3  # the first call eager (engine="auto"), then three runs of the program


def test_the_captured_engine_captures_a_lambda_on_its_first_call():
    net = Cond().double()
    z, t, r, v, y = _data()
    _check_engine = jvpreg.jvp(lambda z: net(z, t, r, y=y), (z,), (v,), engine="captured")
    assert len(_programs(net)) == 1
    ref = torch.func.jvp(lambda z: net(z, t, r, y=y), (z,), (v,))
    torch.testing.assert_close(_check_engine[1], ref[1], rtol=1e-12, atol=1e-12)


def test_a_closed_over_tensor_of_another_shape_or_dtype_records_another_program():
    net = Cond().double()
    z, t, r, v, y = _data()
    f = lambda z: net(z, t, r, y=y)  # noqa: E731
    jvpreg.jvp(f, (z,), (v,), engine="captured")
    z8, t8, r8, v8, y8 = _data(b=8)
    g = lambda z: net(z, t8, r8, y=y8)  # noqa: E731
    _check(g, (z8,), (v8,), engine="captured")
    assert len(_programs(net)) == 2


def test_a_changed_closed_over_number_records_another_program():
    net = Cond().double()
    z, t, r, v, y = _data()
    for w in (0.5, 0.5, 2.0):
        f = functools.partial(net, t=t, r=r, y=y, w=w)
        got = jvpreg.jvp(f, (z,), (v,), engine="captured")
        torch.testing.assert_close(got[1], torch.func.jvp(f, (z,), (v,))[1], rtol=1e-12, atol=1e-12)
    assert len(_programs(net)) == 2


def test_closed_over_tensors_are_inputs_not_constants():
    """A closed-over tensor changed in place (an EMA buffer the user updates) is read at replay, not baked in."""
    net = Cond().double()
    z, t, r, v, y = _data()
    shift = torch.zeros(6, dtype=D)
    f = lambda z: net(z + shift, t, r, y=y) * torch.tanh(shift + z)  # noqa: E731
    jvpreg.jvp(f, (z,), (v,), engine="captured")
    shift.add_(0.7)
    _check(f, (z,), (v,))
    assert len(_programs(net)) == 1 and _programs(net)[0].replays >= 1


def test_several_modules_are_held_together_and_swapping_one_recaptures():
    torch.manual_seed(0)
    enc, dec = nn.Linear(6, 8).double(), nn.Sequential(nn.GELU(), nn.Linear(8, 6)).double()
    z, _, _, v, _ = _data()
    f = lambda x: dec(enc(x))  # noqa: E731
    for _ in range(3):
        _check(f, (z,), (v,))
    holder = callables.take_apart(f).module
    assert isinstance(holder, callables.Holder) and len(_programs(holder)) == 1
    dec[1] = nn.Linear(8, 6).double()  # a swapped submodule: the guard on the children recaptures
    _check(f, (z,), (v,))
    _check(f, (z,), (v,))
    assert _programs(holder)[0].replays >= 1


def test_a_function_of_tensors_only_is_captured():
    w = torch.randn(6, 6, dtype=D)
    f = lambda x: torch.tanh(x @ w).sum(-1)  # noqa: E731
    z, _, _, v, _ = _data()
    for _ in range(3):
        _check(f, (z,), (v,))
    assert len(_programs(callables.take_apart(f).module)) == 1


def test_zero_and_per_sample_scalar_tangents():
    net = Cond().double()
    z, t, r, v, y = _data()
    f = functools.partial(net, y=y)
    for _ in range(3):
        _check(f, (z, t, r), (torch.zeros_like(z), torch.ones_like(t), torch.zeros_like(r)))
        _check(f, (z, t, r), (v, torch.zeros_like(t), torch.zeros_like(r)))
    assert len(_programs(net)) == 1


class Wrapper:
    """A plain object around the model: its module would be reached where no guard sees it."""

    def __init__(self, net):
        self.net = net

    def __call__(self, z):
        return self.net.out(z[:, :8].new_zeros(z.shape[0], 8) + self.net.inp(z))


def test_a_callable_that_cannot_be_guarded_runs_eagerly_with_one_warning():
    net = Cond().double()
    z, _, _, v, _ = _data()
    f = Wrapper(net)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            _check(f, (z,), (v,))
    msgs = [str(w.message) for w in seen if issubclass(w.category, capture.JVPCaptureWarning)]
    assert len(msgs) == 1 and "Wrapper" in msgs[0] and "Pass the model itself" in msgs[0]
    assert not _programs(net)


def test_taking_apart_names_the_same_structure_for_new_instances():
    net = Cond().double()
    a, b = (functools.partial(net, y=torch.zeros(2, dtype=torch.long)) for _ in range(2))
    pa, pb = callables.take_apart(a), callables.take_apart(b)
    assert pa.structure == pb.structure and pa.module is net and pa.values[0] is not pb.values[0]
    assert callables.take_apart(functools.partial(net, w=2.0)).structure != callables.take_apart(
        functools.partial(net, w=3.0)).structure


@pytest.mark.slow
def test_a_rule_registered_after_a_capture_records_the_program_again():
    """The rules a program ran are part of its key (``registry.Handlers.version``): a function captured with one rule
    is not replayed after the rule is replaced (before: the old rule's program replayed)."""
    from jvpreg.clone import register_handler
    from jvpreg.clone.core.registry import HANDLERS
    from jvpreg.clone.core.tensor import wrap

    x, u = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    f = lambda z: torch.tanh(z) * z  # noqa: E731
    holder = callables.take_apart(f).module
    _check(f, (x,), (u,), engine="captured")
    old = HANDLERS[torch.tanh]

    def doubled(func, args, kwargs):  # exact primal, tangents doubled (blocks are x + s u)
        p = old(func, args, kwargs).as_subclass(torch.Tensor)
        return wrap(torch.cat([p[:1], 2 * p[1:] - p[:1]]))

    try:
        register_handler(torch.tanh)(doubled)
        got = jvpreg.jvp(f, (x,), (u,), engine="captured")[1]
        assert not torch.allclose(got, torch.func.jvp(f, (x,), (u,))[1])  # the new rule ran: not the old program
    finally:
        HANDLERS[torch.tanh] = old
    _check(f, (x,), (u,), engine="captured")
    assert len(_programs(holder)) == 3


class Bank:
    """A plain object whose tensors sit in a list field: passed by identity they would be baked into the program."""

    def __init__(self, t):
        self.items = [t]

    def __call__(self, z):
        return torch.tanh(z) * self.items[0]


def test_an_object_holding_tensors_in_a_container_runs_eagerly_and_sees_replaced_tensors():
    z, _, _, v, _ = _data()
    bank = Bank(torch.ones(6, dtype=D))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", capture.JVPCaptureWarning)
        for scale in (1.0, 2.0, 3.0):  # the tensor in the list is replaced between calls
            bank.items[0] = torch.full((6,), scale, dtype=D)
            _check(bank, (z,), (v,), engine="captured")
    assert "Bank" in callables.take_apart(bank).reason
