"""Batch data written into tensors a forward makes from sizes alone (jvpreg.clone.eager.made_tensors), against
torch.func.jvp in float64; the refusals keep BatchWriteError."""
import pytest
import torch
import torch.nn as nn

import jvpreg
from jvpreg.clone.core import session
from jvpreg.clone.eager import made_tensors
from jvpreg.clone.core.errors import BatchWriteError
from conftest import assert_as_plain

DT = torch.float64
ENGINES = ("eager", "captured", "auto")


def _f64(model):
    """``model`` in float64, its complex parameters in complex128 (``Module.to(float64)`` drops imaginary parts)."""
    for p in model.parameters():
        p.data = p.data.to(torch.cdouble if p.is_complex() else DT)
    return model


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _check(model, x, engine, calls=3):
    u = torch.randn_like(x)
    _, ref = torch.func.jvp(model, (x,), (u,))
    for _ in range(calls):  # auto: eager, capture, replay
        y, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
        assert _rel(t, ref) < 1e-12
        assert_as_plain(y, model(x), "output")


class SpectralConv(nn.Module):
    """A Fourier neural operator's spectral convolution as its reference code writes it (``torch.zeros`` of the
    batch size, filled with the retained modes)."""

    def __init__(self, c=3, modes=2):
        super().__init__()
        self.modes = modes
        self.w = nn.Parameter(torch.randn(c, c, modes, modes, dtype=torch.cdouble) / c)

    def forward(self, x):
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(x.shape[0], self.w.shape[1], x.size(-2), x.size(-1) // 2 + 1, dtype=x_ft.dtype)
        m = self.modes
        out_ft[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], self.w)
        out_ft[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m:, :m], self.w)
        return torch.nn.functional.gelu(torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1))) + x)


class Decoder(nn.Module):
    """A recurrent loop that collects its states into ``outputs = torch.zeros(B, T, H)``."""

    def __init__(self, d=4, h=5, steps=3):
        super().__init__()
        self.cell, self.steps, self.h = nn.GRUCell(d, h), steps, h

    def forward(self, x):
        outputs = torch.zeros(x.shape[0], self.steps, self.h, dtype=x.dtype)
        h = torch.zeros(x.shape[0], self.h, dtype=x.dtype)
        for t in range(self.steps):
            h = self.cell(x, h)
            outputs[:, t] = h
        return outputs.tanh()


class InPlaceWrites(nn.Module):
    """Writes through copy_, an in-place add, index_add_ and a new_zeros of a plain tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x).relu()
        a = torch.empty(x.shape[0], 4, dtype=x.dtype)
        a.copy_(h)
        b = torch.ones_like(a.detach().new_ones(x.shape[0], 4))
        b.add_(h * h)
        c = self.lin.weight.new_zeros(x.shape[0] + 1, 4)
        c.index_add_(0, torch.tensor([0, 2, 1]), h)
        return a + b + c[: x.shape[0]]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("build,shape", [(SpectralConv, (2, 3, 8, 8)), (Decoder, (3, 4)), (InPlaceWrites, (3, 4))],
                         ids=["fno_spectral_conv", "decoder_loop", "inplace_writes"])
def test_writes_into_made_tensors_are_exact(build, shape, engine):
    torch.manual_seed(0)
    model = _f64(build())
    _check(model, torch.randn(*shape, dtype=DT), engine)


def _setitem(h):
    out = torch.zeros(h.shape[0], 4, dtype=h.dtype)
    out[:, 0] = h[:, 0]
    return out


def _masked_setitem(h):
    out = torch.zeros(h.shape, dtype=h.dtype)
    out[h > 0] = h[h > 0]
    return out


PLAIN = torch.ones(3, 4, dtype=DT)  # a plain tensor the factories' _like and new_ forms start from

WRITES = {  # each makes the tensor it writes into (the same writes into a tensor made before the forward raise:
    # tests/clone/test_safety.py)
    "setitem": _setitem,
    "masked-setitem": _masked_setitem,
    "copy_": lambda h: torch.zeros(h.shape, dtype=h.dtype).copy_(h),
    "add_": lambda h: torch.zeros_like(PLAIN).add_(h),
    "iadd": lambda h: torch.full(h.shape, 2.0, dtype=h.dtype).__iadd__(h),
    "mul_": lambda h: torch.ones(h.shape, dtype=h.dtype).mul_(h),
    "index_put_": lambda h: PLAIN.new_empty(h.shape).fill_(1).index_put_((torch.tensor([2, 0]),), h[:2]),
    "new_full": lambda h: PLAIN.new_full(h.shape, 0.5).sub_(h),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("write", [pytest.param(w, marks=pytest.mark.slow) if w == "masked-setitem" else w
                                   for w in WRITES])
def test_each_write_into_a_made_tensor(write, engine):
    from conftest import runs_engine

    with runs_engine(engine, calls=3):  # auto: eager on the first call, then the capture and a replay
        _check(lambda x: WRITES[write](torch.tanh(x)) * 2, torch.randn(3, 4, dtype=DT), engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_penalty_gradient_through_made_tensors(engine):
    """The parameter gradient of ||J u||^2 through the writes, vs torch.func."""
    torch.manual_seed(1)
    model = _f64(Decoder())
    x = torch.randn(3, 4, dtype=DT)
    u = torch.randn_like(x)
    params = dict(model.named_parameters())

    def ref_penalty(p):
        f = lambda z: torch.func.functional_call(model, p, (z,))  # noqa: E731
        return torch.func.jvp(f, (x,), (u,))[1].pow(2).sum()

    ref = torch.func.grad(ref_penalty)(params)
    for _ in range(3):
        _, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
        got = torch.autograd.grad(t.pow(2).sum(), list(params.values()))
        for name, g in zip(params, got):
            assert _rel(g, ref[name]) < 1e-12, name


class WritesInto(nn.Module):
    def __init__(self, target_kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(4, 4), target_kind
        self.held = torch.zeros(3, 4, dtype=DT)  # a plain attribute: a cache, not made by this forward

    def forward(self, x, out=None):
        h = self.lin(x)
        if self.kind == "argument":
            target = out
        elif self.kind == "attribute":
            target = self.held
        elif self.kind == "viewed":
            target = torch.zeros(x.shape[0], 4, dtype=x.dtype)
            first = target[:, :2]  # a view taken before the write would not see the blocks
            target[:, 2:] = h[:, 2:]
            return target + first.sum()
        else:  # requires grad
            target = torch.zeros(x.shape[0], 4, dtype=x.dtype, requires_grad=True).clone()
        target[:, :2] = h[:, :2]
        return target


@pytest.mark.parametrize("kind", ["argument", "attribute", "viewed", "requires_grad"])
def test_refused_writes_keep_the_error(kind):
    torch.manual_seed(2)
    model = _f64(WritesInto(kind))
    x = torch.randn(3, 4, dtype=DT)
    kwargs = {"out": torch.zeros(3, 4, dtype=DT)} if kind == "argument" else None
    match = "writes batch data into a tensor created outside the batch"
    if kind == "viewed":  # the message says why a tensor the forward made was not filled
        match += r".*a view of it was taken before this write, .*take views after the writes"
    with pytest.raises(BatchWriteError, match=match):
        jvpreg.jvp(lambda z: model(z, **(kwargs or {})), (x,), (torch.randn_like(x),), engine="eager")
    assert type(model.held) is torch.Tensor and torch.equal(model.held, torch.zeros(3, 4, dtype=DT))


def test_factories_are_the_plain_ones_outside_a_clone_forward():
    originals = dict(made_tensors._ORIGINALS)
    model = _f64(WritesInto("attribute"))
    with pytest.raises(BatchWriteError):
        jvpreg.jvp(model, (torch.randn(3, 4, dtype=DT),), (torch.randn(3, 4, dtype=DT),), engine="eager")
    for (owner, name), factory in originals.items():
        assert getattr(owner, name) is factory
    assert session.current() is None  # what the forward noted went with its session
    _check(_f64(Decoder()), torch.randn(2, 4, dtype=DT), "eager", calls=1)
    assert torch.zeros is originals[(torch, "zeros")]


def test_torchscript_maps_the_noting_factories_to_aten():
    """TorchScript (which torch runs inside a forward: its forward-AD decompositions are scripted on first use)
    resolves the factories by identity."""
    from torch.jit import _builtins

    seen = {}

    class Probe(nn.Module):
        def forward(self, x):
            seen["zeros"] = _builtins._find_builtin(torch.zeros)
            seen["new_zeros"] = _builtins._find_builtin(torch.Tensor.new_zeros)
            seen["noting"] = torch.zeros is not made_tensors._ORIGINALS[(torch, "zeros")]
            return x * 2

    x = torch.randn(2, 3, dtype=DT)
    jvpreg.jvp(Probe(), (x,), (x,), engine="eager")
    plain_new_zeros = _builtins._find_builtin(made_tensors._ORIGINALS[(torch.Tensor, "new_zeros")])
    assert seen == {"zeros": "aten::zeros", "new_zeros": plain_new_zeros, "noting": True}

    @torch.jit.script
    def scripted(n: int):
        return torch.zeros(n) + 1

    assert torch.equal(scripted(3), torch.ones(3))


def _small_fno():
    from jvpreg.bench.capture import _FNO2d

    torch.manual_seed(3)
    return _f64(_FNO2d(width=4, modes=2, layers=2))


@pytest.mark.parametrize("engine", ["eager", pytest.param("auto", marks=pytest.mark.slow)])
def test_regularized_step_through_a_fourier_operator(engine):
    """The callbacks' code path (hooks around the user's forward): the gradient of task loss + ||J u||^2 / B equals
    torch.func's, on every call of the engine (eager, capture, replay)."""
    import copy

    from jvpreg.callbacks.shared import SharedForward
    from jvpreg.losses import JacobianFrobenius

    model = _small_fno()
    x = torch.randn(2, 1, 8, 8, dtype=DT)
    u = torch.randn_like(x)

    class Along(JacobianFrobenius):
        def directions(self, x, context):
            return u[None]

    def ref_loss(p):
        f = lambda z: torch.func.functional_call(model, p, (z,))  # noqa: E731
        y, t = torch.func.jvp(f, (x,), (u,))
        return y.pow(2).mean() + t.pow(2).sum() / x.shape[0]

    ref = torch.func.grad(ref_loss)(dict(model.named_parameters()))
    mine = copy.deepcopy(model)
    shared = SharedForward(mine, engine=engine)
    for _ in range(3):
        mine.zero_grad()
        shared.arm([(Along(1), 1.0, 1.0)])
        loss = mine(x).pow(2).mean() + shared.total()
        shared.disarm()
        loss.backward()
        for name, p in mine.named_parameters():
            assert _rel(p.grad, ref[name]) < 1e-12, name


@pytest.mark.slow
def test_compiled_engine_through_a_fourier_operator():
    model = _small_fno()
    x = torch.randn(2, 1, 8, 8, dtype=DT)
    _check(model, x, "compiled", calls=2)
    _check(torch.compile(model), x, "auto", calls=2)
