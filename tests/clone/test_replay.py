"""The replay function of captured programs (jvpreg.clone.program.replay): checked bindings, the same values and gradients."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import jvpreg
from jvpreg.clone.program import capture, replay

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


def test_a_node_the_meta_walk_cannot_run_keeps_its_handle_and_the_nodes_after_it_are_checked():
    x = torch.tensor([0.0, 1.0, 0.0, 2.0], dtype=D)

    def f(x):
        return torch.nonzero(x).to(D).sum() + x  # nonzero's size depends on values: its recorded shape goes on

    gm = traced(f, x)
    fn = replay.replay_function(gm)
    torch.testing.assert_close(fn(x), gm(x), rtol=0, atol=0)
    bindings, handles = entry_points(fn)
    assert "_op_aten_nonzero_default" in handles
    assert not any("sum" in h or "add" in h for h in handles), handles  # walked on the recorded shapes


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


# --------------------------------------------------------------------------------- PyTorch's op database

def _op_db():
    import expecttest  # noqa: F401  (torch.testing._internal needs it: a dev dependency)
    from torch.testing._internal.common_methods_invocations import op_db

    return [o for o in op_db if D in o.supported_dtypes("cpu")]


QUICK = {"add", "softmax", "index_select"}  # the quick tier (0.8 s an op on the loaded 2 cores); the others: sweep


def _op_params():
    try:
        ops = _op_db()
    except pytest.skip.Exception:
        return []
    key = lambda o: f"{o.name}.{o.variant_test_name}" if o.variant_test_name else o.name  # noqa: E731
    return [pytest.param(o, id=key(o), marks=() if o.name in QUICK and not o.variant_test_name else pytest.mark.sweep)
            for o in ops]


def _flat_tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.to_dense() if t.layout != torch.strided else t
    t = t.resolve_conj().resolve_neg() if t.is_complex() or t.is_neg() else t  # lazy conj/neg bits: materialised
    flat = t.detach().reshape(-1)
    return torch.empty(flat.shape, dtype=flat.dtype).copy_(flat).view(torch.uint8)  # fresh strides (not 0)


def _same(a, b) -> bool:
    """Bitwise equal tensor leaves (NaNs included), with equal shapes and dtypes."""
    a, b = _flat_tensors(a), _flat_tensors(b)
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(_bits(x), _bits(y))
                                    for x, y in zip(a, b))


UNINITIALIZED = {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}


@pytest.mark.parametrize("op", _op_params())
def test_opinfo_replay_equals_the_traced_program(op):
    """Every op of PyTorch's op database, traced as captured programs are: the replay with its checked bindings
    gives bitwise the program's outputs (a binding that picked another overload would show here)."""
    if op.name in UNINITIALIZED:
        pytest.skip("its values are whatever the memory held")
    torch.manual_seed(0)
    samples = list(op.sample_inputs("cpu", D, requires_grad=False))[:4]
    traced_any = False
    for sample in samples:
        args = (sample.input, *sample.args)
        flat, spec = torch.utils._pytree.tree_flatten((args, sample.kwargs))
        pos = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

        def fn(*tensors, flat=flat, spec=spec, pos=pos):
            f = list(flat)
            for i, t in zip(pos, tensors):
                f[i] = t.clone()  # in-place ops must not write the inputs
            a, k = torch.utils._pytree.tree_unflatten(f, spec)
            return op.op(*a, **k)

        inputs = [flat[i] for i in pos]
        try:
            gm = make_fx(fn, tracing_mode="real", pre_dispatch=True)(*inputs)
            torch.manual_seed(1)
            ref = gm(*inputs)
            torch.manual_seed(1)
            again = gm(*inputs)
        except Exception:  # noqa: BLE001 - what make_fx or the program cannot run is not the replay's concern
            continue
        if not _same(ref, again):  # values not set by the seed (empty_like's memory): nothing to compare
            continue
        traced_any = True
        replayed = replay.replay_function(gm)
        torch.manual_seed(1)
        out = replayed(*inputs)
        assert _same(out, ref), f"{op.name}: the replay differs from the program on {sample}"
    if not traced_any:
        pytest.skip("make_fx traces none of its samples")


def test_an_op_of_another_library_is_not_matched_to_a_torch_binding_of_the_same_name():
    lib = torch.library.Library("jvpreg_test_replay", "FRAGMENT")
    lib.define("add(Tensor a, Tensor b) -> Tensor")
    lib.impl("add", lambda a, b: a - b, "CompositeExplicitAutograd")  # not torch.add
    lib.impl("add", lambda a, b: torch.empty_like(a), "Meta")
    op = torch.ops.jvpreg_test_replay.add.default
    assert replay._binding(op) == (None, None)
    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    gm = traced(lambda a, b: op(a, b), x, y)
    fn = replay.replay_function(gm)
    torch.testing.assert_close(fn(x, y), x - y, rtol=0, atol=0)


def test_an_in_place_op_that_changes_its_input_shape_is_checked_on_the_shape_it_was_called_with():
    x = torch.randn(1, 3, dtype=D)
    gm = traced(lambda x: x.clone().squeeze_(0) * 2, x)
    replay._CHECKED.clear()
    fn = replay.replay_function(gm)
    torch.testing.assert_close(fn(x), x[0] * 2, rtol=0, atol=0)
    squeezes = [k for k in replay._CHECKED if "squeeze_" in str(k[0])]
    assert squeezes and all(v[0] is not None for k, v in replay._CHECKED.items() if k in squeezes), replay._CHECKED
