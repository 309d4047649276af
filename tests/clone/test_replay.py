"""The replay function of captured programs (jvpreg.clone.replay): checked bindings, the same values and gradients."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import jvpreg
from jvpreg.clone import capture, replay

D = torch.float64
aten = torch.ops.aten


def entry_points(fn):
    """(bindings, handles): the names the replay's code calls through a binding and through an operator handle."""
    names = fn.__func__.__code__.co_names
    glob = fn.__func__.__globals__
    handles = {n for n in names if n.startswith("_op_")}
    bindings = {n for n in names if n in glob and not n.startswith("_op_") and callable(glob[n])
                and type(glob[n]).__name__ == "builtin_function_or_method"}
    return bindings, handles


def traced(fn, *inputs):
    return make_fx(fn, tracing_mode="real", pre_dispatch=True)(*inputs)


def same_values_and_grads(gm, inputs):
    fn = replay.replay_function(gm)
    args = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    ref_args = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out, ref = fn(*args), gm(*ref_args)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [a for a in args if a.requires_grad], g)
    ref_grads = torch.autograd.grad(ref, [a for a in ref_args if a.requires_grad], g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    return fn


def test_bindings_give_the_same_values_and_gradients():
    torch.manual_seed(0)
    w, x = torch.randn(5, 4, dtype=D), torch.randn(3, 2, 4, dtype=D)

    def f(x, w):
        h = torch.nn.functional.linear(x, w).transpose(0, 1)
        h = torch.nn.functional.gelu(h[0] - h[1]).unsqueeze(0)
        return torch.stack([h.softmax(-1), h * 0.5]).reshape(2, -1).sum(0)

    fn = same_values_and_grads(traced(f, x, w), [x, w])
    bindings, handles = entry_points(fn)
    assert bindings and not handles, (bindings, handles)  # every op here has a binding that passes the check


def test_an_overload_the_binding_would_not_pick_keeps_its_handle():
    # torch.add(x, 2) runs add.Tensor with a wrapped number, not the node's add.Scalar: the check must refuse it
    x = torch.randn(4, dtype=D)
    g = torch.fx.Graph()
    a = g.placeholder("x")
    a.meta["val"] = x
    g.output(g.call_function(aten.add.Scalar, (a, 2)))
    gm = torch.fx.GraphModule({}, g)
    fn = replay.replay_function(gm)
    assert entry_points(fn) == (set(), {"_op_aten_add_Scalar"})
    torch.testing.assert_close(fn(x), x + 2, rtol=0, atol=0)


def test_a_node_the_meta_walk_cannot_run_keeps_its_handle_and_runs():
    x = torch.tensor([0.0, 1.0, 0.0, 2.0], dtype=D)

    def f(x):
        return torch.nonzero(x).to(D).sum() + x  # nonzero's size depends on values: no meta result downstream

    gm = traced(f, x)
    fn = replay.replay_function(gm)
    torch.testing.assert_close(fn(x), gm(x), rtol=0, atol=0)
    assert "_op_aten_nonzero_default" in entry_points(fn)[1]


def test_factory_ops_keep_their_handles():
    x = torch.randn(3, dtype=D)
    gm = traced(lambda x: x + torch.ones(3, dtype=D), x)
    fn = replay.replay_function(gm)
    assert any("ones" in h for h in entry_points(fn)[1])
    torch.testing.assert_close(fn(x), x + 1, rtol=0, atol=0)


def test_captured_jvp_runs_on_bindings_and_equals_eager_clone_mode():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16), nn.ReLU(),
                        nn.Linear(16, 3)).to(D)
    x, u = torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D)
    y, t = jvpreg.jvp(net, (x,), (u,), engine="captured")
    y0, t0 = jvpreg.jvp(net, (x,), (u,), engine="eager")
    torch.testing.assert_close((y, t), (y0, t0), rtol=0, atol=0)
    (prog,) = capture.programs(net).values()
    bindings, handles = entry_points(prog.replay)
    assert len(bindings) >= 5, bindings
    _, ref = torch.func.jvp(net, (x,), (u,))
    torch.testing.assert_close(t, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("grad", [False, True])
def test_verdicts_are_remembered_per_operator_and_arguments(grad):
    replay._CHECKED.clear()
    x = torch.randn(2, 3, dtype=D, requires_grad=grad)
    gm = traced(lambda x: (x - x.exp()) - x.exp(), x)
    replay.replay_function(gm)
    subs = [k for k in replay._CHECKED if k[0] is aten.sub.Tensor]
    assert len(subs) == 1  # two sub nodes with the same described arguments: one check
