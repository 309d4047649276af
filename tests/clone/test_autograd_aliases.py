"""What a clone answers when code asks autograd whether it is a view, and where its gradient hooks go.

A clone is an autograd alias of the whole physical batch it wraps. ``._base`` / ``._is_view()`` must still answer as
they do for the plain tensor of a plain forward (FSDP2 warns about every module output that is a view), and a
gradient hook registered on a clone must survive an in-place update of it (FSDP2 unshards parameters for backward
from such a hook; on a view the update regenerates the ``grad_fn`` and drops it).
"""
from __future__ import annotations

import pytest
import torch

import jvpreg

D = torch.float64

OPS = {
    "matmul": lambda y: y,
    "relu": torch.relu,
    "add_": lambda y: y.add_(1),
    "clone": lambda y: y.clone(),
    "contiguous-of-transpose": lambda y: y.t().contiguous(),
    "contiguous": lambda y: y.contiguous(),
    "to-its-own-dtype": lambda y: y.to(y.dtype),
    "float64": lambda y: y.double(),
    "requires_grad_": lambda y: y.requires_grad_(),
    "detach": lambda y: y.detach(),
    "slice": lambda y: y[:, :2],
    "select": lambda y: y[0],
    "transpose": lambda y: y.t(),
    "view": lambda y: y.view(-1),
    "view_as": lambda y: y.view_as(y),
    "view-of-view": lambda y: y.view(-1).view(2, 3),
    "reshape": lambda y: y.reshape(3, 2),
    "unsqueeze": lambda y: y.unsqueeze(0),
    "expand": lambda y: y[:, :1].expand(2, 3),
}


def packed(x: torch.Tensor, k: int = 1):
    (xc,), s = jvpreg.clone.pack((x,), (torch.randn(k, *x.shape, dtype=D),))
    return xc, s


@pytest.mark.parametrize("engine", ["eager", "captured"])
@pytest.mark.parametrize("op", OPS, ids=list(OPS))
def test_a_clone_is_a_view_exactly_when_the_plain_tensor_is(op, engine):
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    x = torch.randn(2, 3, dtype=D)
    plain = OPS[op](x @ w)
    want = (plain._base is not None, plain._is_view())
    seen = []

    def f(xc):
        y = OPS[op](xc @ w)
        seen.append((y._base is not None, y._is_view()))
        return y

    for _ in range(2):  # the second call of a signature is captured and replays
        jvpreg.clone.call(f, (packed(x)[0],), engine=engine)
    assert seen and all(got == want for got in seen), f"{op}: plain (_base, _is_view) = {want}, clone {seen}"


def _hooked_step(in_place: bool):
    """``out = 2 (x W + 1)`` with a hook on ``x W`` registered before the ``+ 1`` (in place or not)."""
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    xc, s = packed(torch.randn(2, 3, dtype=D), k=2)
    grads = []

    def f(xc):
        y = xc @ w
        y.register_hook(lambda g: grads.append(g.clone()))
        if in_place:
            y += 1
        else:
            y = y + 1
        return 2 * y

    out, tan = jvpreg.clone.unpack(jvpreg.clone.call(f, (xc,), engine="eager"), s)
    (out.pow(2).sum() + tan.pow(2).sum()).backward()
    return grads, w.grad


def test_a_gradient_hook_on_a_clone_survives_an_in_place_update():
    """The hook fires once with the physical ``(K, *L)`` gradient, the same as without the in-place update."""
    grads, w_grad = _hooked_step(in_place=True)
    want, w_want = _hooked_step(in_place=False)
    assert len(grads) == 1 and grads[0].shape == (3, 2, 3)
    torch.testing.assert_close(grads[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(w_grad, w_want, rtol=0, atol=0)


def test_a_hook_on_a_view_of_a_clone_receives_the_views_gradient():
    """A view the forward made keeps its own hook, as torch hooks a view: the gradient of the slice, per block."""
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    xc, s = packed(torch.randn(2, 3, dtype=D))
    grads = []

    def f(xc):
        y = (xc @ w)[:, :2]
        y.register_hook(lambda g: grads.append(g.clone()))
        return 3 * y

    out, _ = jvpreg.clone.unpack(jvpreg.clone.call(f, (xc,), engine="eager"), s)
    out.sum().backward()  # the primal block's gradient only
    assert len(grads) == 1 and grads[0].shape == (2, 2, 2)
    torch.testing.assert_close(grads[0], torch.stack([torch.full((2, 2), 3.0, dtype=D), torch.zeros(2, 2, dtype=D)]),
                               rtol=0, atol=0)


@pytest.mark.parametrize("view", ["view_as", "view-of-view", "slice"])
def test_hooks_on_a_result_and_on_a_view_of_it_receive_what_plain_hooks_receive(view):
    """``v = view(y)`` with both consumed: the hook on ``y`` sees the gradient through ``v`` too, the hook on ``v``
    only ``v``'s; block 0 equals the plain forward's hooks (the loss reads the primal block, so tangent blocks get 0)."""
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    x = torch.randn(2, 3, dtype=D)
    make = OPS[view]

    def f(z, log):
        y = z @ w
        v = make(y)
        y.register_hook(lambda g: log.append(("y", g.clone())))
        v.register_hook(lambda g: log.append(("v", g.clone())))
        return 2 * v.sum() + (3 * y).sum()

    want = []
    f(x, want).backward()
    got = []
    xc, s = packed(x)
    out, _ = jvpreg.clone.unpack(jvpreg.clone.call(lambda z: f(z, got), (xc,), engine="eager"), s)
    out.backward()
    assert [n for n, _ in got] == [n for n, _ in want] == ["v", "y"]
    for (name, g), (_, g_want) in zip(got, want):
        assert g.shape == (2, *g_want.shape), name
        torch.testing.assert_close(g[0], g_want, rtol=0, atol=0, msg=lambda m: f"hook on {name}: {m}")
        assert g[1].abs().max() == 0, name


def test_a_hook_on_a_batch_a_rule_computed_in_another_shape_sees_the_batch_shape():
    """A rule that computes its batch as a reshape of a 2-d result (torch 2.11's linear on 3-d inputs): the hook, put
    on that 2-d base, receives and returns the gradient in the batch's ``(K, *L)`` shape, and what it returns is the
    gradient that flows on."""
    from jvpreg.clone.core.tensor import raw, wrap

    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    xc, s = packed(torch.randn(2, 3, dtype=D))
    seen = []

    def f(z, scale_grad):
        flat = raw(z @ w).reshape(-1, 3) * 2  # (K*2, 3), a result of its own
        y = wrap(flat.view(2, 2, 3))
        if scale_grad:
            y.register_hook(lambda g: seen.append(tuple(g.shape)) or 3 * g)
        return y * 1.0

    grads = []
    for scale_grad in (False, True):
        w.grad = None
        out, _ = jvpreg.clone.unpack(jvpreg.clone.call(lambda z: f(z, scale_grad), (xc,), engine="eager"), s)
        out.sum().backward()
        grads.append(w.grad.clone())
    assert seen == [(2, 2, 3)]
    torch.testing.assert_close(grads[1], 3 * grads[0], rtol=1e-14, atol=0)


def test_requires_grad_on_a_clone_sets_its_own_flag_and_returns_it():
    """``z.requires_grad_()`` on a clone that needs no gradient, as torch: the flag is ``z``'s, the return value is
    ``z``, and the gradient reaches it."""
    x = torch.randn(2, 3, dtype=D)
    xc, s = packed(x)
    seen = []

    def f(z):
        r = z.requires_grad_()
        seen.append((r is z, z.requires_grad))
        return 2 * z

    out, _ = jvpreg.clone.unpack(jvpreg.clone.call(f, (xc,), engine="eager"), s)
    out.sum().backward()
    assert seen == [(True, True)]
    with torch._C.DisableTorchFunctionSubclass():
        grad = xc.grad
    torch.testing.assert_close(grad[0], torch.full((2, 3), 2.0, dtype=D), rtol=0, atol=0)


def test_retain_grad_stays_on_the_clone():
    w = torch.randn(3, 3, dtype=D, requires_grad=True)
    xc, s = packed(torch.randn(2, 3, dtype=D))
    kept = []

    def f(xc):
        y = xc @ w
        y.retain_grad()
        kept.append(y)
        return 2 * y

    out, _ = jvpreg.clone.unpack(jvpreg.clone.call(f, (xc,), engine="eager"), s)
    out.sum().backward()
    with torch._C.DisableTorchFunctionSubclass():
        grad = kept[0].grad
    assert grad is not None and grad.shape == (2, 2, 3)
    torch.testing.assert_close(grad[0], torch.full((2, 3), 2.0, dtype=D), rtol=0, atol=0)
