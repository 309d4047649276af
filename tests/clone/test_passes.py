"""Graph passes over captured programs (jvpreg.clone.program.passes): fewer ops, the same values and gradients."""
from __future__ import annotations

import collections
import copy
import operator

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvpreg
from jvpreg.clone.program import capture, passes
from jvpreg.clone.program.passes import analysis, batch_norm_relu, infinities


@pytest.fixture(autouse=True)
def capture_on_first_call(monkeypatch):
    """The programs inspected here are captured by the first call (``engine="auto"`` waits for the second)."""
    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", 0)

D = torch.float64
aten = torch.ops.aten


def ops(gm):
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def check(fn, *inputs, finite=()):
    """Trace ``fn``, run the passes, and compare values and gradients with the untouched function."""
    gm = make_fx(fn, tracing_mode="real", pre_dispatch=True)(*inputs)
    before = ops(gm)
    passes.optimize(gm, finite)
    args = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    ref_args = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out, ref = gm(*args), fn(*ref_args)
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
    if out.is_floating_point():
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, [a for a in args if a.requires_grad], g)
        ref_grads = torch.autograd.grad(ref, [a for a in ref_args if a.requires_grad], g)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    return before, ops(gm)


def rule_like(h, w):
    """What a smooth rule writes for one tangent: ``[out(a); out(a) + k(z_1 - a) * w]``."""
    a = h[0]
    d = h[1:] - a
    t = torch.tanh(d[0]).unsqueeze(0) * w
    return torch.cat([a.unsqueeze(0), a + t]).to(h.dtype)


def test_rule_output_becomes_one_stack_with_the_block_read_directly():
    h, w = torch.randn(2, 3, 4, dtype=D), torch.randn(4, dtype=D)
    before, after = check(rule_like, h, w)
    assert after[aten.stack.default] == 1 and not after[aten.cat.default] and not after[aten.unsqueeze.default]
    assert not after[aten.slice.Tensor] and not after[aten.to.dtype]
    assert sum(after.values()) < sum(before.values())


def test_same_rank_operands_are_not_moved():
    """``b + unsqueeze(c)`` with ``b`` of ``c``'s rank + 1 is not ``unsqueeze(b + c)``: left alone."""
    def f(b, c):
        return torch.cat([(2 * c).unsqueeze(0), b + c.unsqueeze(0)])

    before, after = check(f, torch.randn(1, 4, dtype=D), torch.randn(4, dtype=D))
    assert after[aten.cat.default] == 1


def masked(x):
    d = x[1:] - x[0]
    return d.masked_fill(torch.isnan(d) & (x[1:] == x[0]), 0)


@pytest.mark.parametrize("finite", [True, False])
def test_nonfinite_fix_dropped_only_for_finite_inputs(finite):
    x = torch.randn(2, 3, dtype=D)
    _, after = check(masked, x, finite=(finite,))
    assert (after[aten.isnan.default] == 0) == finite


def test_inf_constant_keeps_the_fix():
    def f(x):
        return masked(x.masked_fill(torch.eye(3, dtype=torch.bool), -float("inf")))

    _, after = check(f, torch.randn(2, 3, 3, dtype=D), finite=(True,))
    assert after[aten.isnan.default] == 1


@pytest.mark.parametrize("source, fixed", [
    (lambda x: torch.tanh(x.masked_fill(torch.arange(3) == 1, -float("inf"))), False),      # bounded op
    (lambda x: torch.log(x.detach().abs().masked_fill(torch.arange(3) == 1, 0.0)), True),   # log(0) = -inf
    (lambda x: torch.rsqrt(torch.var_mean(x, 0, correction=0)[0] + 1e-5) * x, False),       # BN's invstd
    (lambda x: torch.rsqrt(x.abs() + 0.0) * x, True),                                        # rsqrt(0) = inf
])
def test_bounded_ops_and_variance_invstd_are_finite_other_infinities_keep_the_fix(source, fixed):
    """The fix of a rule's output block: dropped where the analysis proves block 0 finite (a bounded op, an
    invstd of a variance plus eps, a block read back out of its stack), kept where an infinity can arise."""
    def f(x):
        a = source(x[0])
        return masked(torch.cat([a.unsqueeze(0), a + 2 * (x[1:] - x[0])]))

    _, after = check(f, torch.randn(2, 4, 3, dtype=D), finite=(True,))
    assert (after[aten.isnan.default] == 1) == fixed


@pytest.mark.parametrize("source, fixed", [
    (lambda x: torch.nn.functional.layer_norm(x[0], (3,)), False),  # normalised: no infinity, whatever x holds
    (lambda x: x[0], True),                                          # the data's own row
])
def test_the_first_row_is_followed_apart_from_the_tangent_rows(source, fixed):
    """With the data possibly infinite (on a device its finiteness is not read), a rule's output block 0 computed
    from a layer norm holds no infinity while its tangent rows may: through a product that keeps dim 0 apart (linear,
    a transpose of other dims) the next rule's primal block is finite and its fix dropped; from the data itself kept."""
    w = torch.randn(5, 3, dtype=D)

    def f(x):
        a = source(x)
        h = torch.cat([a.unsqueeze(0), a + (x[1:] - x[0])])  # [a; a + t]: t from the data, possibly infinite
        return masked(torch.nn.functional.linear(h, w).transpose(1, 2).transpose(1, 2))

    _, after = check(f, torch.randn(2, 4, 3, dtype=D), finite=(False,))
    assert (after[aten.isnan.default] == 1) == fixed


def test_a_row_mixing_op_keeps_the_fix():
    """``flip(0)`` swaps the primal and tangent rows: block 0 is then a tangent row, which may be infinite."""
    def f(x):
        a = torch.nn.functional.layer_norm(x[0], (3,))
        return masked(torch.cat([a.unsqueeze(0), a + (x[1:] - x[0])]).flip(0))

    _, after = check(f, torch.randn(2, 4, 3, dtype=D), finite=(False,))
    assert after[aten.isnan.default] == 1


def _vit():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2, hidden_dim=8,
                                                mlp_dim=16, num_classes=3).to(D).eval()


@pytest.mark.parametrize("infinite", ["x", "u"])
@pytest.mark.slow
def test_a_vit_with_an_infinite_input_keeps_no_fix_and_equals_the_eager_engine(infinite):
    """An infinite entry in the data or the direction (what a device's program must allow for): the ViT's smooth
    ops all read layer-normed rows (finite or NaN), so its program holds no non-finite fix, and it gives the eager
    engine's values, NaN where they are NaN."""
    model = _vit()
    x, u = torch.randn(2, 3, 16, 16, dtype=D), torch.randn(2, 3, 16, 16, dtype=D)
    (x if infinite == "x" else u)[1, 0, 3, 5] = float("inf")
    y, t = jvpreg.jvp(model, (x,), (u,), engine="captured")
    (prog,) = capture.programs(model).values()
    assert not ops(prog.gm)[aten.eq.Tensor], "a non-finite fix is left"
    ref_y, ref_t = jvpreg.jvp(model, (x,), (u,), engine="eager")
    torch.testing.assert_close((y, t), (ref_y, ref_t), rtol=1e-12, atol=1e-12, equal_nan=True)
    assert torch.isfinite(t[0]).all() and (torch.isnan(t[1]).all() if infinite == "x" else True)


def test_train_mode_batch_norm_with_an_infinite_input_keeps_no_fix_and_equals_the_eager_engine():
    """Train-mode BatchNorm normalises by the batch's statistics: its output's primal block is never infinite, so the
    hardswish after it keeps no fix (the batch norm's own input keeps its: the data's infinity is there); its running
    statistics, read by it and then updated in place, do not stop the analysis. Values (NaN where they are NaN) and
    running statistics equal the eager engine's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Hardswish(), nn.Conv2d(4, 2, 3)).to(D).train()
    twin = copy.deepcopy(model)
    x, u = torch.randn(3, 3, 8, 8, dtype=D), torch.randn(3, 3, 8, 8, dtype=D)
    x[1, 0, 2, 2] = float("inf")
    y, t = jvpreg.jvp(model, (x,), (u,), engine="captured")
    (prog,) = capture.programs(model).values()
    assert ops(prog.gm)[aten.eq.Tensor] == 1, "the hardswish's non-finite fix is left"
    ref_y, ref_t = jvpreg.jvp(twin, (x,), (u,), engine="eager")
    torch.testing.assert_close((y, t), (ref_y, ref_t), rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(model[1].running_mean, twin[1].running_mean, rtol=0, atol=0, equal_nan=True)


@pytest.mark.slow
def test_a_meta_program_counts_parameters_finite():
    """On ``meta`` (``scripts/op_counts.py``: a GPU's code paths without values) parameters count as finite, as a
    GPU's capture reads them: the ViT's program there holds no fix either."""
    model = _vit().float().to("meta")
    x = torch.randn(2, 3, 16, 16, device="meta")
    jvpreg.jvp(model, (x,), (torch.randn_like(x),), engine="captured")
    (prog,) = capture.programs(model).values()
    assert not ops(prog.gm)[aten.eq.Tensor]


def test_jvp_of_a_module_is_one_program_with_pack_and_unpack():
    """jvpreg.jvp on a module records x, u, s -> (y, J u) as one program; BatchNorm's invstd does not keep the
    output's non-finite fix; a second call replays it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    model = model.to(D).train()
    x, u = torch.randn(2, 3, 6, 6, dtype=D), torch.randn(2, 3, 6, 6, dtype=D)
    y, t = jvpreg.jvp(model, (x,), (u,))
    (prog,) = capture.programs(model).values()
    counted = ops(prog.gm)
    n_in = sum(n.op == "placeholder" for n in prog.gm.graph.nodes)
    assert n_in == 3 + len(list(model.parameters())) + len(list(model.buffers()))  # x, u, s and the tensors
    assert counted[aten.div.Tensor] == 1 and not counted[aten.isnan.default]
    ref = jvpreg.jvp(model, (x,), (u,), engine="eager")[1]
    torch.testing.assert_close(jvpreg.jvp(model, (x,), (u,))[1], ref, rtol=1e-12, atol=1e-12)
    assert len(capture.programs(model)) == 1


@pytest.mark.slow
def test_captured_transformer_block_uses_the_passes():
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True,
                                       activation="gelu").to(D).eval()
    x, u = torch.randn(2, 5, 16, dtype=D), torch.randn(2, 5, 16, dtype=D)
    _, t = jvpreg.jvp(model, (x,), (u,), engine="captured")
    with sdpa_kernel(SDPBackend.MATH):  # the fused CPU kernel has no forward AD
        _, ref = torch.func.jvp(model, (x,), (u,))
    torch.testing.assert_close(t, ref, rtol=1e-10, atol=1e-12)
    (prog,) = capture.programs(model).values()
    counted = ops(prog.gm)
    assert counted[aten.stack.default] > 0 and not counted[aten.isnan.default]


def test_permute_chains_fold():
    def f(x):
        y = x * 2
        a, b = y.permute(2, 0, 1).permute(0, 2, 1), y.permute(1, 0, 2).permute(1, 0, 2)  # (4, 3, 2), identity
        return a.reshape(-1) * b.reshape(-1)

    before, after = check(f, torch.randn(2, 3, 4, dtype=D))
    assert before[aten.permute.default] == 4 and after[aten.permute.default] == 1


def test_block_reads_keep_their_place_before_an_in_place_write():
    """``select(h + y)`` read after ``h`` is written in place: the hoisted read must still see the old ``h``."""
    def f(x, y):
        h = x * 1
        t = h + y
        h.mul_(2)
        return t.select(0, 0) * 3

    before, after = check(f, torch.randn(2, 3, dtype=D), torch.randn(3, dtype=D))
    assert after[aten.select.int] == 1


def test_fix_kept_when_its_output_is_written_in_place_and_the_difference_read_elsewhere():
    """Dropping the fix would make the in-place write land in ``z - a`` itself, which another op reads."""
    def f(x):
        d = x[1:] - x[0]
        fixed = d.masked_fill(torch.isnan(d) & (x[1:] == x[0]), 0)
        fixed.mul_(2)
        return d * fixed

    check(f, torch.randn(3, 4, dtype=D), finite=(True,))


def test_contiguous_operand_goes_first_so_the_sum_is_contiguous():
    """``h.transpose(0, 1) + c`` (leading dims swapped, as an attention output plus its residual): the pass puts
    ``c`` first, the result is contiguous (LayerNorm then copies nothing). A view whose last dim is not innermost
    (channels-last) keeps its layout; broadcasting operands are left alone."""
    def f(h, c, v, w):
        s = h.transpose(0, 1) + c
        return torch.layer_norm(s, (4,)) + (h.transpose(0, 1) * v) + (w.transpose(1, 2) + c)

    h, c = torch.randn(3, 2, 4, dtype=D), torch.randn(2, 3, 4, dtype=D)
    v, w = torch.randn(4, dtype=D), torch.randn(2, 4, 3, dtype=D)
    gm = make_fx(f, tracing_mode="real", pre_dispatch=True)(h, c, v, w)
    passes.optimize(gm, ())
    adds = [n for n in gm.graph.nodes if n.target is aten.add.Tensor and
            any(isinstance(a, torch.fx.Node) and a.target is aten.transpose.int for a in n.args)]
    swapped = [n for n in adds if n.args[1].target is aten.transpose.int]
    kept = [n for n in adds if n.args[0].target is aten.transpose.int]
    assert [n.args[1].args[0].name for n in swapped] == ["h_1"], gm.code  # h's view went second
    assert [n.args[0].args[0].name for n in kept] == ["w_1"], gm.code     # w's view (last dim moved) stayed first
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    assert mul.args[0].target is aten.transpose.int  # v broadcasts: not swapped
    check(f, h, c, v, w)


@pytest.mark.parametrize("args, kwargs, bounded", [
    ((), {}, True), ((-2.0, 2.0), {}, True), ((-float("inf"), 1.0), {}, False),
    ((), {"min_val": -float("inf"), "max_val": 1.0}, False),  # keyword bounds are not read: not known bounded
])
def test_hardtanh_is_bounded_only_with_finite_known_bounds(args, kwargs, bounded):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(aten.hardtanh.default, (x, *args), kwargs)
    assert infinities._bounded(node) == bounded


def _graded(fn, *inputs, tracing_mode="real"):
    """``fn`` traced as capture records it under autograd (every node marked as recorded in grad mode); with
    ``tracing_mode="fake"`` the nodes carry fake values, as a capture's do."""
    gm = make_fx(fn, tracing_mode=tracing_mode, pre_dispatch=True)(*inputs)
    for node in gm.graph.nodes:
        node.meta["jvpreg_grad"] = True
    return gm


@pytest.mark.slow
def test_block_reads_under_autograd_become_one_split_with_the_same_values_and_gradients():
    def fn(z, w):
        h = z * w
        a, rest, second = h[0], h[1:], h[1]
        return torch.stack([a.sin(), (rest * a).sum(0), second.cos()])

    z, w = torch.randn(3, 4, 5, dtype=D), torch.randn(5, dtype=D)
    gm = _graded(fn, z, w)
    passes.optimize(gm)
    counts = ops(gm)
    assert counts[aten.split_with_sizes.default] == 1 and counts[aten.slice.Tensor] == 0
    zs, ws = z.clone().requires_grad_(), w.clone().requires_grad_()
    zr, wr = z.clone().requires_grad_(), w.clone().requires_grad_()
    out, ref = gm(zs, ws), fn(zr, wr)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (zs, ws), g), torch.autograd.grad(ref, (zr, wr), g)):
        torch.testing.assert_close(a, b, rtol=1e-15, atol=1e-15)


def test_a_tensor_written_in_place_keeps_its_select_and_slice():
    """A multi-view split forbids in-place writes to its base: a tensor (or a view of it) that an op writes into
    is read as before."""
    def fn(z):
        h = z * 2
        a, rest = h[0], h[1:]
        h[0].add_(1)
        return (rest * a).sum()

    z = torch.randn(3, 4, dtype=D)
    gm = _graded(fn, z)
    passes.optimize(gm)
    assert ops(gm)[aten.split_with_sizes.default] == 0
    zs = z.clone().requires_grad_()
    torch.testing.assert_close(gm(zs), fn(z))
    torch.autograd.grad(gm(zs), zs)


@pytest.mark.parametrize("norm", [lambda: nn.BatchNorm2d(6), lambda: nn.GroupNorm(2, 6)], ids=["batch", "group"])
def test_train_norm_program_reads_blocks_through_splits_and_drops_the_nonfinite_fix(norm):
    """The normalisation operators (namespace jvpreg) keep finite inputs finite: the fix after them is dropped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), norm(), nn.Tanh(), nn.Conv2d(6, 2, 3)).to(D).train()
    x, u = torch.randn(4, 3, 7, 7, dtype=D), torch.randn(4, 3, 7, 7, dtype=D)
    jvpreg.jvp(model, (x,), (u,))
    (prog,) = capture.programs(model).values()
    counted = ops(prog.gm)
    assert any(t.namespace == "jvpreg" for t in counted if isinstance(t, torch._ops.OpOverload))
    assert counted[aten.split_with_sizes.default] >= 1 and not counted[aten.isnan.default]


def _same_values_and_grads(gm, fn, *inputs):
    args = [x.detach().clone().requires_grad_() for x in inputs]
    ref_args = [x.detach().clone().requires_grad_() for x in inputs]
    out, ref = gm(*args), fn(*ref_args)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, args, g), torch.autograd.grad(ref, ref_args, g)):
        torch.testing.assert_close(a, b, rtol=1e-15, atol=1e-15)


def _backward_ops(out, inputs):
    """The aten ops the backward of ``out`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = collections.Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[func] += 1
            return func(*args, **(kwargs or {}))

    with Record():
        torch.autograd.grad(out.sum(), inputs)
    return seen


def _write_back(z):
    """An in-place rule's shape: ``h`` made by the program, a new tensor made from it written back into it."""
    h = z * 2
    y = torch.tanh(h)
    h.copy_(y)
    return h[0] * h.reshape(-1)[:4].sum()


def test_an_in_place_write_back_becomes_the_new_tensor():
    """``copy_(h, f(h))`` -> ``f(h)``: every later read of ``h`` reads ``f(h)``; the backward has no zero gradient for
    the old ``h`` (``copy_``'s) and no sum with it."""
    z = torch.randn(2, 3, 4, dtype=D)
    gm = _graded(_write_back, z)
    passes.optimize(gm)
    assert not ops(gm)[aten.copy_.default]
    _same_values_and_grads(gm, _write_back, z)
    zs = z.clone().requires_grad_()
    assert not _backward_ops(gm(zs), [zs])[aten.zeros_like.default]


@pytest.mark.parametrize("fn", [
    lambda z: (z.copy_(torch.tanh(z * 2)) * 1).sum(0),                   # the written tensor is an input
    lambda z: (lambda h: (lambda v: (h.copy_(torch.tanh(h)), v * 3)[1])(h[0]))(z * 2),  # a view made before
    lambda z: (lambda h, y: (h.copy_(y), h * y)[1])(z * 2, torch.tanh(z)),  # the new tensor is read elsewhere
], ids=["input", "view_before", "value_read_again"])
def test_a_write_back_that_others_see_stays_a_copy(fn):
    z = torch.randn(2, 3, dtype=D)
    gm = _graded(fn, z.clone())
    passes.optimize(gm)
    assert ops(gm)[aten.copy_.default] == 1
    torch.testing.assert_close(gm(z.clone()), fn(z.clone()), rtol=0, atol=0)


def test_one_tangent_block_against_the_primal_is_read_without_broadcasting():
    """``z[1:] - z[0]`` for one tangent: the ``(1, ...)`` block is squeezed, so the backward hands the primal its
    gradient without a reduction over the leading 1 (no ``sum``)."""
    def fn(z, w):
        h = z * w
        return (h[1:] - h[0]) * h[0]

    z, w = torch.randn(2, 3, 4, dtype=D), torch.randn(4, dtype=D)
    gm = _graded(fn, z, w, tracing_mode="fake")
    passes.optimize(gm)
    _same_values_and_grads(gm, fn, z, w)
    zs, ws = z.clone().requires_grad_(), w.clone().requires_grad_()
    counted = _backward_ops(gm(zs, ws), [zs, ws])
    assert counted[aten.sum.dim_IntList] == 1  # w's own reduction only


def test_without_autograd_one_tangent_block_keeps_its_broadcast():
    """Recorded without autograd there is no backward to spare: no squeeze and unsqueeze around each op."""
    def fn(z, w):
        h = z * w
        return (h[1:] - h[0]) * h[0]

    z, w = torch.randn(2, 3, 4, dtype=D), torch.randn(4, dtype=D)
    gm = _graded(fn, z, w, tracing_mode="fake")
    for node in gm.graph.nodes:
        node.meta["jvpreg_grad"] = False
    passes.optimize(gm)
    assert ops(gm)[aten.squeeze.dim] == 0
    with torch.no_grad():
        torch.testing.assert_close(gm(z, w), fn(z, w), rtol=0, atol=0)


def test_an_op_of_two_unsqueezed_blocks_is_unsqueezed_once():
    def fn(a, b):
        return (a.unsqueeze(0) * 2.0) + (b.unsqueeze(0) - 1.0)

    a, b = torch.randn(3, 4, dtype=D), torch.randn(4, dtype=D)
    before, after = check(fn, a, b)
    assert after[aten.unsqueeze.default] == 1 and before[aten.unsqueeze.default] == 2


def test_every_entry_selected_becomes_one_unbind():
    """``p[:, 0], p[:, 1], p[:, 2]`` (attention's q, k, v) -> ``unbind(p, 1)``: one backward stack instead of three
    zero-filled full-size gradients and their sum."""
    def fn(x, w):
        p = (x @ w).unflatten(-1, (3, 2))
        q, k, v = p[:, 0], p[:, 1], p[:, 2]
        return q * k + v

    x, w = torch.randn(4, 5, dtype=D), torch.randn(5, 6, dtype=D)
    gm = _graded(fn, x, w)
    passes.optimize(gm)
    counted = ops(gm)
    assert counted[aten.unbind.int] == 1 and not counted[aten.select.int]
    _same_values_and_grads(gm, fn, x, w)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    assert not _backward_ops(gm(xs, ws), [xs, ws])[aten.select_backward.default]


def test_some_entries_selected_stay_selects():
    def fn(x):
        p = x * 2
        return p[:, 0] * p[:, 2]

    gm = _graded(fn, torch.randn(4, 3, dtype=D))
    passes.optimize(gm)
    assert not ops(gm)[aten.unbind.int]
    _same_values_and_grads(gm, fn, torch.randn(4, 3, dtype=D))


def test_select_of_a_single_entry_dim_is_a_squeeze():
    def fn(x):
        return (x * 2).select(1, 0).exp()

    x = torch.randn(3, 1, 4, dtype=D)
    gm = _graded(fn, x, tracing_mode="fake")
    passes.optimize(gm)
    assert not ops(gm)[aten.select.int] and ops(gm)[aten.squeeze.dim] == 1
    _same_values_and_grads(gm, fn, x)


@pytest.mark.slow
def test_resnet_program_has_no_write_backs_and_matches_eager():
    """The in-place ReLUs of a ResNet: its captured program writes nothing back, and its JVP and the gradients of a
    penalty on it equal the eager engine's in float64."""
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).to(D).train()
    x, u = torch.randn(3, 3, 32, 32, dtype=D), torch.randn(3, 3, 32, 32, dtype=D)
    results = {}
    for engine in ("captured", "eager"):
        model.zero_grad()
        _, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
        t.pow(2).sum().backward()
        results[engine] = (t.detach(), [p.grad.clone() for p in model.parameters()])
    (prog,) = capture.programs(model).values()
    stats_ops = (torch.ops.jvpreg.batch_norm_blocks.default, torch.ops.jvpreg.batch_norm_relu_blocks.default)
    copies = [n for n in prog.gm.graph.nodes if n.target is aten.copy_.default]
    assert all(n.args[0].op == "placeholder" and n.args[1].args[0].target in stats_ops for n in copies), \
        "only the running statistics are written"
    assert len(copies) == 2 * sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    torch.testing.assert_close(results["captured"][0], results["eager"][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(results["captured"][1], results["eager"][1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


class _ConvBNReLU(nn.Module):
    """Conv -> BN -> ReLU(inplace) (fusable), then Conv -> BN read by a ReLU and a residual sum (not fusable)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        g = self.bn2(self.conv2(h))
        return (torch.relu(g) + g).flatten(1)


def test_batch_norm_read_only_by_a_relu_is_fused(monkeypatch):
    """A BatchNorm whose output only a relu reads becomes one operator in the captured program (the other BatchNorm
    stays); JVP, penalty gradients and running statistics equal the eager engine's in float64."""
    import copy

    import jvpreg.clone.rules.cpa as cpa

    monkeypatch.setattr(cpa, "BOOL_MASK_NUMEL", 0)  # relu_blocks on blocks of any size (as on large activations)
    torch.manual_seed(0)
    model = _ConvBNReLU().to(D).train()
    eager_model = copy.deepcopy(model)
    x, u = torch.randn(5, 3, 6, 6, dtype=D), torch.randn(5, 3, 6, 6, dtype=D)
    results = {}
    for engine, m in (("captured", model), ("eager", eager_model)):
        _, t = jvpreg.jvp(m, (x,), (u,), engine=engine)
        t.pow(2).sum().backward()
        results[engine] = (t.detach(), [p.grad for p in m.parameters()], list(m.buffers()))
    (prog,) = capture.programs(model).values()
    counted = ops(prog.gm)
    assert counted[torch.ops.jvpreg.batch_norm_relu_blocks.default] == 1
    assert counted[torch.ops.jvpreg.batch_norm_blocks.default] == 1
    torch.testing.assert_close(results["captured"][0], results["eager"][0], rtol=1e-12, atol=1e-12)
    for a, b in zip(results["captured"][1] + results["captured"][2], results["eager"][1] + results["eager"][2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_batch_norm_output_read_twice_is_not_fused():
    """Two reads of the BatchNorm output (two ``getitem`` nodes, as CSE leaves them across a write) keep the two
    operators: fusing would hand the relu'd values to the other reader."""
    from jvpreg.clone.rules import kernels  # noqa: F401  (registers the operators)

    graph = torch.fx.Graph()
    z = graph.placeholder("z")
    bn = graph.call_function(torch.ops.jvpreg.batch_norm_blocks.default, (z, None, None, None, None, 0.1, 1e-5))
    first, second = (graph.call_function(operator.getitem, (bn, 0)) for _ in range(2))
    relu = graph.call_function(torch.ops.jvpreg.relu_blocks.default, (first,))
    out = graph.call_function(operator.getitem, (relu, 0))
    graph.output((out, second))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    zt = torch.randn(2, 4, 3, dtype=D)
    want = gm(zt)
    batch_norm_relu.fuse_batch_norm_relu(gm.graph)
    gm.recompile()
    assert not ops(gm)[torch.ops.jvpreg.batch_norm_relu_blocks.default]
    got = gm(zt)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (got[1] < 0).any(), "the second reader sees BatchNorm's output, negative entries included"


def test_alias_classes_follow_views_and_keep_a_multi_result_ops_results_apart():
    """``topk``'s values and indices are two tensors (a write into one leaves the other); ``split``'s parts, a view
    and an in-place result share their base's memory."""
    def f(x):
        values, indices = torch.topk(x, 2, dim=1)
        values /= values.sum(1, keepdim=True)
        first, rest = x.split([1, 3], 0)
        y = x.view(-1)
        y.add_(1.0)
        return values, indices.float(), first, rest

    gm = make_fx(f, tracing_mode="real", pre_dispatch=True)(torch.randn(4, 5, dtype=D))
    classes = analysis.alias_classes(gm.graph)
    by_target = collections.defaultdict(list)
    for n in gm.graph.nodes:
        by_target[n.target].append(n)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    topk = by_target[aten.topk.default][0]
    values, indices = sorted((u for u in topk.users), key=lambda u: u.args[1])
    assert classes[values] != classes[indices] and classes[values] != classes[x]
    assert classes[by_target[aten.div_.Tensor][0]] == classes[values]
    parts = by_target[aten.split_with_sizes.default][0]
    assert all(classes[u] == classes[x] for u in parts.users)
    assert classes[by_target[aten.view.default][0]] == classes[x] == classes[by_target[aten.add_.Tensor][0]]
    last = analysis.last_writes(gm.graph)
    assert indices not in last and last[values] < last[x]  # the add_ comes after the div_
