"""Tensors a forward stores on its modules (jvpreg.clone.eager.stored_clones): their primal after the clone forward, a
constant of the next call as torch.func.jvp has it, and what a plain forward would have stored."""
import pytest
import torch
import torch.nn as nn

import jvpreg
from jvpreg.clone.core import session
from conftest import assert_as_plain

DT = torch.float64


class Memory(nn.Module):
    """Keeps its last state for the next call, and an attention-like map for a plot; ``where``: a plain attribute,
    or a registered buffer."""

    def __init__(self, detach=True, where="attribute"):
        super().__init__()
        self.lin, self.detach = nn.Linear(4, 4), detach
        if where == "buffer":
            self.register_buffer("mem", None)
        else:
            self.mem = None

    def forward(self, x):
        h = self.lin(x).tanh()
        if self.mem is not None:
            h = h * self.mem
        self.mem = h.detach() if self.detach else h
        self.attn_map = h.softmax(-1).detach()
        return h


def _reference(model, x, u):
    """torch.func.jvp of the same call on a copy whose stored state is the model's (a constant of the call)."""
    ref = Memory(model.detach).to(DT)
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if k != "mem"}, strict=False)
    ref.mem = None if model.mem is None else model.mem.detach()
    return torch.func.jvp(ref, (x,), (u,))[1]


@pytest.mark.parametrize("engine", ["eager", "captured", "auto"])
@pytest.mark.parametrize("detach", [True, False], ids=["detached", "with_history"])
@pytest.mark.parametrize("where", ["attribute", "buffer"])
def test_stored_state_is_the_primal_after_the_forward(engine, detach, where):
    torch.manual_seed(0)
    model = Memory(detach, where).to(DT)
    twin = Memory(detach, where).to(DT)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(3, 4, dtype=DT)
    for _ in range(3):
        u = torch.randn_like(x)
        want = _reference(model, x, u)
        y, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
        assert ((t - want).norm() / want.norm()).item() < 1e-12  # the previous call's state is a constant
        twin(x)  # what a plain forward stores
        for name in ("mem", "attn_map"):
            stored = getattr(model, name)
            assert_as_plain(stored, getattr(twin, name), name)
        assert model.mem.requires_grad == (not detach)
        assert ("mem" in model._buffers) == (where == "buffer")
    assert_as_plain(model(x), twin(x), "output")  # a plain forward after the clone forwards reads a plain tensor


class FilledBuffer(nn.Module):
    """Stores a tensor it makes, then fills it with batch data (the write turns it into a clone batch)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.buf = torch.zeros(x.shape[0], 6, dtype=x.dtype)
        self.buf[:, 1:5] = self.lin(x).tanh()
        return self.buf.sin()


@pytest.mark.parametrize("engine", ["eager", "captured", "auto"])
def test_a_made_tensor_stored_then_filled_is_the_primal_after_the_forward(engine):
    torch.manual_seed(2)
    model, twin = FilledBuffer().to(DT), FilledBuffer().to(DT)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(3, 4, dtype=DT)
    for _ in range(2):
        u = torch.randn_like(x)
        want = torch.func.jvp(twin, (x,), (u,))[1]
        y, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
        assert ((t - want).norm() / want.norm()).item() < 1e-12
        assert torch.equal(y, twin(x))  # twin(x): what a plain forward stores
        assert type(model.buf) is torch.Tensor and torch.equal(model.buf, twin.buf)
    assert torch.equal(model(x), twin(x))


def test_stored_clone_is_the_primal_also_when_the_forward_raises():
    class Raises(nn.Module):
        def forward(self, x):
            self.kept = x * 2
            raise ValueError("boom")

    model = Raises()
    x = torch.randn(2, 3, dtype=DT)
    with pytest.raises(ValueError, match="boom"):
        jvpreg.jvp(model, (x,), (torch.randn_like(x),), engine="eager")
    assert type(model.kept) is torch.Tensor and torch.equal(model.kept, x * 2)
    assert session.current() is None  # nothing of the forward is kept


def test_regularized_step_leaves_a_plain_model():
    """The callbacks' code path: after a regularized training step the model's stored state is plain."""
    from jvpreg.callbacks.shared import SharedForward
    from jvpreg.losses import JacobianFrobenius

    torch.manual_seed(1)
    model = Memory().to(DT)
    shared = SharedForward(model, engine="auto")
    x = torch.randn(3, 4, dtype=DT)
    for _ in range(3):
        shared.arm([(JacobianFrobenius(1), 1.0, 1.0)])
        loss = model(x).sum() + shared.total()
        shared.disarm()
        loss.backward()
        assert type(model.mem) is torch.Tensor and type(model.attn_map) is torch.Tensor
    model.eval()
    with torch.no_grad():
        model(x)  # validation: a plain forward reads the stored state


class _State:
    """A plain object the module holds (a settings or state object)."""


class Logs(nn.Module):
    """Stores around nn.Module.__setattr__: items of a list, a dict and a tuple on the module, a ``__dict__`` write,
    a field of an object the module holds, and a stored tensor on a submodule."""

    def __init__(self):
        super().__init__()
        self.lin, self.inner = nn.Linear(4, 4), nn.Identity()
        self.log, self.maps, self.pair, self.state = [], {}, None, _State()

    def forward(self, x):
        h = self.lin(x).tanh()
        self.log.append(h.detach())
        self.maps["last"] = [h.exp().detach()]
        self.pair = (h.sum(-1).detach(), 3)
        self.__dict__["raw"] = h * 2
        self.inner.seen = h.cos()
        self.state.h = h.sin()
        self.__dict__["size"] = h.shape  # a tuple of ints: left as it is
        return h


def _stored(model):
    return [model.log[-1], model.maps["last"][0], model.pair[0], model.raw, model.inner.seen, model.state.h]


@pytest.mark.parametrize("engine", ["eager", "auto"])
@pytest.mark.parametrize("as_function", [False, True], ids=["module", "closure"])
def test_stores_in_containers_dunder_dict_and_submodules_are_primal(engine, as_function):
    torch.manual_seed(3)
    model, twin = Logs().to(DT), Logs().to(DT)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(3, 4, dtype=DT)
    f = (lambda z: model(z)) if as_function else model
    for _ in range(3):
        u = torch.randn_like(x)
        want = torch.func.jvp(twin, (x,), (u,))[1]
        _, t = jvpreg.jvp(f, (x,), (u,), engine=engine)
        assert ((t - want).norm() / want.norm()).item() < 1e-12
        for got, ref in zip(_stored(model), _stored(twin)):  # twin: stored by a plain forward (inside torch.func)
            assert type(got) is torch.Tensor and torch.allclose(got, ref.detach(), rtol=0, atol=1e-12)
        assert model.pair[1] == 3 and model.size == torch.Size([3, 4])
    assert all(type(t) is torch.Tensor for t in model.log) and len(model.log) == 3
    assert session.current() is None  # nothing of the forward is kept

