"""The public API: torch.func-compatible ``jvp``, ``jvp_params``, and every validation error.

References are ``torch.func.jvp`` in float64 (``torch.autograd.forward_ad`` for train-mode
BatchNorm); every error message is pinned with ``pytest.raises(..., match=...)``.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import jvpreg
from conftest import assert_tree_close
from jvpreg.clone import fallback_mode

D = torch.float64
RTOL = 1e-10
WHERE = r"jvpreg\.jvp\(func, primals, tangents\): "
WHERE_P = r"jvpreg\.jvp_params\(module, primals, param_tangents\): "


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, dtype=D)


# ----------------------------------------------------------------------------- call convention


def two_outputs(x):
    return x.tanh(), (x * x).sum(1)


def dict_output(x):
    return {"act": F.relu(x), "nested": [x.sin(), {"sq": x.pow(2)}]}


def aux_tensor(x):
    y = x.tanh()
    return y, y.detach().sum()


def aux_dict(x):
    return x.exp(), {"norm": x.pow(2).sum().sqrt(), "rows": x[:, 0]}


def several_primals(x, w):
    return x @ w.tanh(), (x.sin() * x).sum(0) + w[:, 0]


@pytest.mark.parametrize("func", [two_outputs, dict_output], ids=["tuple", "dict-nested"])
def test_pytree_outputs_match_torch_func(func):
    x, u = randn(3, 4), randn(3, 4)
    with fallback_mode("error"):
        out = jvpreg.jvp(func, (x,), (u,))
    assert_tree_close(out, torch.func.jvp(func, (x,), (u,)))


@pytest.mark.parametrize("func", [aux_tensor, aux_dict], ids=["aux-tensor", "aux-dict"])
def test_has_aux_returns_aux_of_the_primal(func):
    x, u = randn(3, 4), randn(3, 4)
    with fallback_mode("error"):
        y, t, aux = jvpreg.jvp(func, (x,), (u,), has_aux=True)
    y_ref, t_ref, aux_ref = torch.func.jvp(func, (x,), (u,), has_aux=True)
    assert_tree_close((y, t), (y_ref, t_ref))
    assert type(aux) is type(aux_ref)
    assert not isinstance(aux, jvpreg.clone.CloneTensor)
    if isinstance(aux, dict):
        assert aux.keys() == aux_ref.keys()
        for key in aux:
            assert not isinstance(aux[key], jvpreg.clone.CloneTensor)
            torch.testing.assert_close(aux[key], aux_ref[key], rtol=1e-12, atol=0)
    else:
        torch.testing.assert_close(aux, aux_ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("func", [torch.sin, lambda x: x * x.exp(), lambda x: torch.stack([x, x.relu()])],
                         ids=["sin", "product", "stack"])
def test_0_dim_primals_are_accepted_like_torch_func(func):
    x, u = torch.tensor(0.7, dtype=D), torch.tensor(-1.3, dtype=D)
    assert_tree_close(jvpreg.jvp(func, (x,), (u,)), torch.func.jvp(func, (x,), (u,)))


def test_several_primals():
    x, w = randn(3, 4), randn(4, 2)
    tx, tw = randn(3, 4), randn(4, 2)
    with fallback_mode("error"):
        out = jvpreg.jvp(several_primals, (x, w), (tx, tw))
    assert_tree_close(out, torch.func.jvp(several_primals, (x, w), (tx, tw)))


def test_list_primals_are_accepted_like_tuples():
    x, u = randn(3, 4), randn(3, 4)
    assert_tree_close(jvpreg.jvp(torch.sin, [x], [u]), jvpreg.jvp(torch.sin, (x,), (u,)))


def mlp():
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)).to(D)


def test_batched_tangents_equal_separate_calls():
    model = mlp()
    x, us = randn(3, 4), randn(3, 3, 4)
    with fallback_mode("error"):
        y, ts = jvpreg.jvp(model, (x,), (us,), batched_tangents=True)
        separate = [jvpreg.jvp(model, (x,), (us[j],)) for j in range(3)]
    assert ts.shape == (3, 3, 2)
    for j, (y_j, t_j) in enumerate(separate):
        torch.testing.assert_close(y, y_j, rtol=0, atol=0)
        torch.testing.assert_close(ts[j], t_j, rtol=RTOL, atol=1e-14)
        torch.testing.assert_close(ts[j], torch.func.jvp(model, (x,), (us[j],))[1], rtol=RTOL, atol=1e-14)


def test_batched_tangents_train_batchnorm_one_statistics_update():
    """k tangents through clone-BN: each equals its own call, and running stats are updated once per call."""
    net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, momentum=None), nn.ReLU(), nn.Flatten()).to(D).train()
    plain = copy.deepcopy(net)
    x, us = randn(4, 2, 5, 5), randn(3, 4, 2, 5, 5)
    with fallback_mode("error"):
        y, ts = jvpreg.jvp(net, (x,), (us,), batched_tangents=True)
    plain(x)
    for (name, b), (_, b_plain) in zip(net.named_buffers(), plain.named_buffers()):
        torch.testing.assert_close(b, b_plain, rtol=1e-14, atol=0, msg=lambda m: f"{name}: {m}")
    for j in range(3):
        with fallback_mode("error"):
            _, t_j = jvpreg.jvp(copy.deepcopy(net), (x,), (us[j],))
        torch.testing.assert_close(ts[j], t_j, rtol=RTOL, atol=1e-13)


def test_batched_tangents_several_primals_and_pytree_output():
    x, w = randn(3, 4), randn(4, 2)
    tx, tw = randn(2, 3, 4), randn(2, 4, 2)
    with fallback_mode("error"):
        y, ts = jvpreg.jvp(several_primals, (x, w), (tx, tw), batched_tangents=True)
    for j in range(2):
        _, t_ref = torch.func.jvp(several_primals, (x, w), (tx[j], tw[j]))
        assert_tree_close(tuple(t[j] for t in ts), t_ref)


@pytest.mark.parametrize("scale", ["auto", 1.0, 1e-3, 2.0 ** 20, 3])
def test_scale_fixed_or_auto_gives_the_same_jvp(scale):
    model = mlp()
    x, u = randn(3, 4), randn(3, 4)
    with fallback_mode("error"):
        y, t = jvpreg.jvp(model, (x,), (u,), scale=scale)
    y_ref, t_ref = torch.func.jvp(model, (x,), (u,))
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-15)
    torch.testing.assert_close(t, t_ref, rtol=1e-8, atol=1e-12)


def test_scale_auto_is_a_power_of_two_per_tangent():
    x = randn(3, 4)
    us = torch.stack([randn(3, 4), 1e-3 * randn(3, 4), torch.zeros(3, 4, dtype=D)])
    s = jvpreg.clone.choose_scales([(x, us)], 3)
    assert s.shape == (3,)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))
    assert s[1] > s[0] and s[2] == 1.0  # a zero tangent keeps scale 1



def _reference_scales(x, us, ratio):
    """s_j = 2^round(log2(ratio ||x|| / ||u_j||)) over the finite entries, in float64 (1 for a zero tangent); an
    exponent above log2(max of x's dtype) becomes that less 4 (representable where the blocks are formed)."""
    def norm(t):
        t = t.double()
        return float(torch.where(torch.isfinite(t), t, 0).norm())

    nx = norm(x) or 1.0
    top = int(math.log2(torch.finfo(x.dtype).max))

    def exponent(u):
        e = round(math.log2(ratio * nx / norm(u)))
        return top - 4 if e > top else max(-top, e)

    return [2.0 ** exponent(u) if norm(u) > 0 else 1.0 for u in us]


@pytest.mark.parametrize("case", ["plain", "huge_float32", "nonfinite", "one_tangent", "requires_grad"])
def test_cpu_scale_choice_matches_the_formula_and_says_whether_inputs_are_finite(case):
    from jvpreg.clone.api import _R_DEFAULT, _choose_scales

    torch.manual_seed(0)
    x, us = torch.randn(3, 5), torch.randn(2, 3, 5)
    if case == "huge_float32":  # finite, but the float32 sum of squares overflows: redone in float64; the scale
        x = x * 1e30  # 2^40 ||x|| / ||u|| would overflow float32: the largest one float32 holds (with a margin)
    if case == "nonfinite":
        x[0, 0], us[1, 2, 3] = float("inf"), float("nan")
    if case == "one_tangent":
        us = us[:1]
    if case == "requires_grad":
        x.requires_grad_(True)
    s, finite = _choose_scales([(x, us)], us.shape[0])
    assert s.dtype == torch.float64 and s.tolist() == _reference_scales(x.detach(), us, _R_DEFAULT)
    assert finite is (case in ("plain", "one_tangent", "requires_grad"))

@pytest.mark.parametrize("engine", ["eager", "captured"])
@pytest.mark.parametrize("dtype,size", [(torch.float32, 1e-30), (torch.float32, 1e30), (torch.float64, 1e-300),
                                        (torch.float64, 1e300), (torch.float64, 1e-20)])
def test_tangents_far_smaller_or_larger_than_the_primal_are_exact(dtype, size, engine):
    """The scale is chosen in logs, from norms whose squares cannot underflow: a float32 tangent of entries 1e-25
    had a float32 norm of 0, hence scale 1 and a zero JVP; 1e-300 in float64 overflowed the quotient the same way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    x, u = torch.randn(4, 6, dtype=dtype), torch.randn(4, 6, dtype=torch.float64)
    for _ in range(2):
        _, t = jvpreg.jvp(model, (x,), ((u * size).to(dtype),), engine=engine)
    _, ref = torch.func.jvp(model.double(), (x.double(),), (u,))  # J (u size) / size: the JVP is linear
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(t.double() / size, ref, rtol=tol, atol=tol)


def test_a_representable_scale_is_not_clamped():
    """Only a scale its dtype cannot hold is clamped: a float16 tangent 1e-4 times the primal keeps
    2^round(log2(4 ||x|| / ||u||)) = 2^15 (the largest power of two float16 holds)."""
    from jvpreg.clone.api import _choose_scales, device_scales

    torch.manual_seed(0)
    x = torch.randn(64, dtype=torch.float16)
    us = (x.float() * 1e-4).to(torch.float16)[None]
    s, _ = _choose_scales([(x, us)], 1)
    assert s.tolist() == [2.0 ** 15] and torch.equal(device_scales([(x, us)], 1, 4.0), s)


def test_a_primal_whose_norm_overflows_gets_the_largest_scale():
    """Entries near float64's maximum: their norm overflows to inf, and the scale is the largest one the dtype holds
    (as on a device) instead of an ``OverflowError`` (found by the captured OpInfo sweep, on hypot's extreme sample)."""
    from jvpreg.clone.api import _R_DEFAULT, SCALE_MARGIN, _choose_scales, _max_exponent, device_scales

    x, us = torch.full((4,), 1.5e308, dtype=torch.float64), torch.ones(1, 4, dtype=torch.float64)
    s, finite = _choose_scales([(x, us)], 1)
    assert s.tolist() == [2.0 ** (_max_exponent(torch.float64) - SCALE_MARGIN)] and finite is False
    assert torch.equal(device_scales([(x, us)], 1, _R_DEFAULT), s)


def test_device_scale_choice_equals_the_cpu_one():
    """:func:`device_scales` (kernels, no host sync) on CPU tensors: the CPU choice, extreme tangents included."""
    from jvpreg.clone.api import _R_DEFAULT, _choose_scales, device_scales

    torch.manual_seed(0)
    for dtype, sizes in ((torch.float32, (1.0, 1e-30, 1e30, 0.0)), (torch.float64, (1.0, 1e-300, 1e300, 0.0))):
        x, w = torch.randn(3, 5, dtype=dtype), torch.randn(4, dtype=dtype)
        us = torch.stack([torch.randn(3, 5, dtype=dtype) * c for c in sizes])
        uw = torch.stack([torch.randn(4, dtype=dtype) * c for c in sizes])
        for pairs in ([(x, us)], [(x, us), (w, uw)]):
            cpu, _ = _choose_scales(pairs, len(sizes))
            assert torch.equal(device_scales(pairs, len(sizes), _R_DEFAULT), cpu), (dtype, len(pairs))
            assert cpu[-1] == 1.0 and torch.isfinite(cpu).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_device_scale_choice_equals_the_cpu_one_on_special_values(dtype, monkeypatch):
    """The special cases the device folds into ``nan_to_num`` of the logs: a zero primal, primals and tangents with
    infinities and NaNs (their finite entries choose), a zero tangent, a primal whose norm overflows, and a
    tangent whose own norm overflows: the host's choice in each (the choice only: the host then refuses blocks that
    overflow, ``test_nonfinite.py``)."""
    from jvpreg.clone import api
    from jvpreg.clone.api import _choose_scales, _ratio, device_scales

    monkeypatch.setattr(api, "_check_blocks_fit", lambda *args: None)

    big = torch.finfo(dtype).max / 2
    inf, nan = float("inf"), float("nan")
    primals = {"zero": [0.0, 0.0, 0.0, 0.0], "inf": [1.0, inf, -2.0, 0.5], "nan": [nan, 3.0, 1.0, -1.0],
               "all inf": [inf, -inf, inf, inf], "huge": [big, big, -big, big], "plain": [0.3, -1.2, 2.0, 0.7]}
    tangents = [[1.0, 2.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0], [inf, 1.0, 0.0, 2.0], [nan, nan, 1e-3, 0.0],
                [big, -big, big, big], [1e-4, 0.0, 0.0, 0.0]]
    us = torch.tensor(tangents, dtype=dtype)
    for name, values in primals.items():
        x = torch.tensor(values, dtype=dtype)
        cpu, _ = _choose_scales([(x, us)], len(tangents))
        dev = device_scales([(x, us)], len(tangents), _ratio(dtype, "cpu"))
        assert torch.equal(dev, cpu), (name, dev.tolist(), cpu.tolist())
        assert torch.isfinite(cpu).all() and cpu[1] == 1.0  # a zero tangent keeps scale 1


def test_zero_tangent_gives_zero_jvp():
    x = randn(3, 4)
    y, t = jvpreg.jvp(mlp(), (x,), (torch.zeros_like(x),))
    assert torch.equal(t, torch.zeros_like(t))


def test_inputs_and_module_are_not_modified():
    model = mlp()
    state = copy.deepcopy(model.state_dict())
    x, u = randn(3, 4), randn(3, 4)
    x0, u0 = x.clone(), u.clone()
    jvpreg.jvp(model, (x,), (u,))
    assert torch.equal(x, x0) and torch.equal(u, u0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])
        assert type(v) is torch.Tensor
    assert all(type(p) is nn.Parameter for p in model.parameters())


# ----------------------------------------------------------------------------- validation errors

X = torch.zeros(3, 4, dtype=D)

JVP_ERRORS = [
    {"id": "func-not-callable", "args": (42, (X,), (X,)), "kwargs": {}, "error": TypeError,
     "match": WHERE + "expected func to be callable, got int"},
    {"id": "primals-tensor", "args": (torch.sin, X, (X,)), "kwargs": {}, "error": TypeError,
     "match": WHERE + r"expected primals to be a tuple of tensors\. E\.g\. it should be valid to call f\(\*primals\)\. "
                      r"Got Tensor"},
    {"id": "primals-dict", "args": (torch.sin, {"x": X}, (X,)), "kwargs": {}, "error": TypeError,
     "match": WHERE + "expected primals to be a tuple of tensors.*Got dict"},
    {"id": "tangents-tensor", "args": (torch.sin, (X,), X), "kwargs": {}, "error": TypeError,
     "match": WHERE + "expected tangents to be a tuple of tensors, got Tensor"},
    {"id": "length-mismatch", "args": (torch.add, (X, X), (X,)), "kwargs": {}, "error": ValueError,
     "match": WHERE + "expected primals and tangents to have the same length, got 2 and 1"},
    {"id": "empty", "args": (torch.sin, (), ()), "kwargs": {}, "error": ValueError,
     "match": WHERE + "expected at least one primal"},
    {"id": "primal-not-tensor", "args": (torch.sin, (1.5,), (X,)), "kwargs": {}, "error": TypeError,
     "match": WHERE + "expected primals to be a tuple of tensors, got float at index 0"},
    {"id": "tangent-not-tensor", "args": (torch.sin, (X,), ([0.0],)), "kwargs": {}, "error": TypeError,
     "match": WHERE + "expected tangents to be a tuple of tensors, got list at index 0"},
    {"id": "shape-mismatch", "args": (torch.sin, (X,), (torch.zeros(3, 5, dtype=D),)), "kwargs": {},
     "error": ValueError, "match": WHERE + r"tangents\[0\] has shape \(3, 5\), expected \(3, 4\)\.$"},
    {"id": "shape-mismatch-second", "args": (torch.add, (X, X), (X, torch.zeros(4, 3, dtype=D))), "kwargs": {},
     "error": ValueError, "match": WHERE + r"tangents\[1\] has shape \(4, 3\), expected \(3, 4\)"},
    {"id": "batched-missing-k", "args": (torch.sin, (X,), (X,)), "kwargs": {"batched_tangents": True},
     "error": ValueError,
     "match": WHERE + r"tangents\[0\] has shape \(3, 4\), expected \(3, 4\) "
                      r"\(batched_tangents=True expects a leading k dim\)"},
    {"id": "batched-k-mismatch",
     "args": (torch.add, (X, X), (torch.zeros(2, 3, 4, dtype=D), torch.zeros(3, 3, 4, dtype=D))),
     "kwargs": {"batched_tangents": True}, "error": ValueError,
     "match": WHERE + r"every tangent must carry the same number of directions k, got \[2, 3\]"},
    # the tangent rides in its primal's batch: torch.func.jvp accepts a float64 tangent of a float32 primal, a cat of
    # the blocks would promote the batch to float64 (a float32 model then fails inside with a dtype error)
    {"id": "tangent-dtype", "args": (torch.sin, (X.float(),), (X,)), "kwargs": {}, "error": ValueError,
     "match": WHERE + r"tangents\[0\] is torch\.float64 on cpu, primals\[0\] torch\.float32 on cpu: .* must share "
                      r"dtype and device \(pass tangents\[0\]\.to\(primals\[0\]\)\)"},
    {"id": "tangent-device", "args": (torch.sin, (X,), (X.to("meta"),)), "kwargs": {}, "error": ValueError,
     "match": WHERE + r"tangents\[0\] is torch\.float64 on meta, primals\[0\] torch\.float64 on cpu"},
    {"id": "batched-no-direction", "args": (torch.sin, (X,), (torch.zeros(0, 3, 4, dtype=D),)),
     "kwargs": {"batched_tangents": True}, "error": ValueError,
     "match": WHERE + r"tangents\[0\] holds no direction \(k = 0\); batched_tangents=True needs k >= 1"},
    {"id": "int-primal", "args": (torch.sin, (torch.zeros(3, dtype=torch.long),), (torch.zeros(3),)),
     "kwargs": {}, "error": TypeError,
     "match": WHERE + r"primals\[0\] has dtype torch\.int64; JVPs need floating-point primals"},
    {"id": "bool-primal", "args": (torch.sin, (torch.zeros(3, dtype=torch.bool),), (torch.zeros(3),)),
     "kwargs": {}, "error": TypeError, "match": WHERE + r"primals\[0\] has dtype torch\.bool"},
    # complex: the rules linearise real functions (tanh, sigmoid, products gave wrong tangents, 4.4 off for tanh)
    {"id": "complex-primal", "args": (torch.tanh, (torch.zeros(3, dtype=torch.complex128),),
                                      (torch.zeros(3, dtype=torch.complex128),)),
     "kwargs": {}, "error": TypeError,
     "match": WHERE + r"primals\[0\] has dtype torch\.complex128; clone mode supports real floating-point"},
    {"id": "has_aux-without-tuple", "args": (torch.sin, (X,), (X,)), "kwargs": {"has_aux": True},
     "error": TypeError, "match": WHERE + r"has_aux=True expects func to return a \(output, aux\) tuple"},
] + [
    {"id": f"bad-scale-{name}", "args": (torch.sin, (X,), (X,)), "kwargs": {"scale": value}, "error": ValueError,
     "match": r"scale: expected 'auto' or a positive finite number, got " + pattern}
    for name, value, pattern in [
        ("zero", 0.0, "0.0"), ("negative", -1, "-1"), ("nan", math.nan, "nan"), ("inf", math.inf, "inf"),
        ("string", "big", "'big'"), ("tensor", torch.tensor(2.0), "tensor"),
    ]
]


@pytest.mark.parametrize("case", JVP_ERRORS, ids=[c["id"] for c in JVP_ERRORS])
def test_jvp_validation_errors(case):
    with pytest.raises(case["error"], match=case["match"]):
        jvpreg.jvp(*case["args"], **case["kwargs"])


def test_validation_runs_before_func():
    calls = []

    def f(x):
        calls.append(1)
        return x

    for bad in [dict(tangents=(torch.zeros(2, 2, dtype=D),)), dict(scale=-1.0)]:
        kwargs = {"scale": bad.get("scale", "auto")}
        with pytest.raises(ValueError):
            jvpreg.jvp(f, (X,), bad.get("tangents", (X,)), **kwargs)
    assert calls == []


# ----------------------------------------------------------------------------- jvp_params


class Looked(nn.Module):
    """An embedding looked up at fixed indices, added to the input (a transformer's position embedding)."""

    def __init__(self, **embedding):
        super().__init__()
        self.emb = nn.Embedding(6, 4, **embedding)
        self.register_buffer("ids", torch.tensor([0, 2, 2]))

    def forward(self, x):
        return torch.tanh(x + self.emb(self.ids)) * self.emb(self.ids.flip(0))


class Bilinear(nn.Module):
    """Parameters used directly, not through a layer: ``x @ self.W`` and ``self.scale * x``."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(4, 5))
        self.scale = nn.Parameter(torch.randn(5))
        self.gain = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.gain * torch.tanh(self.scale * (x @ self.W))


class Tied(nn.Module):
    """Encoder weight reused, transposed, by the decoder."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 3)
        self.dec_bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return F.linear(F.relu(self.enc(x)), self.enc.weight.t(), self.dec_bias)


class TiedSame(nn.Module):
    """The same Linear applied twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class SharedParameter(nn.Module):
    """One Parameter object registered under two names."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def conv_net(dim: int, transpose: bool = False):
    conv = getattr(nn, f"Conv{dim}d")
    layers = [conv(2, 3, 3, padding=1), nn.ReLU()]
    if transpose:
        layers += [nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1), nn.Tanh()]
    else:
        layers += [conv(3, 2, 3, stride=2), nn.Tanh()]
    return nn.Sequential(*layers)


def bn_net():
    net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 2, 1))
    with torch.no_grad():
        net[1].weight.normal_()
        net[1].bias.normal_()
        net[1].running_mean.normal_()
        net[1].running_var.uniform_(0.5, 1.5)
    return net


PARAM_SETTINGS = [
    {"id": "linear-weight", "module": lambda: nn.Linear(4, 3), "input_shape": (3, 4), "names": ["weight"]},
    {"id": "linear-bias", "module": lambda: nn.Linear(4, 3), "input_shape": (3, 4), "names": ["bias"]},
    {"id": "mlp-middle-weight", "module": mlp, "input_shape": (3, 4), "names": ["2.weight"]},
    {"id": "mlp-several", "module": mlp, "input_shape": (3, 4), "names": ["0.weight", "2.bias", "4.weight"]},
    {"id": "conv1d-weight", "module": lambda: conv_net(1), "input_shape": (2, 2, 8), "names": ["2.weight"]},
    {"id": "conv2d-weight-bias", "module": lambda: conv_net(2), "input_shape": (2, 2, 6, 6),
     "names": ["0.weight", "0.bias"]},
    {"id": "conv3d-weight", "module": lambda: conv_net(3), "input_shape": (2, 2, 4, 4, 4), "names": ["0.weight"]},
    {"id": "conv_transpose2d-weight", "module": lambda: conv_net(2, transpose=True), "input_shape": (2, 2, 5, 5),
     "names": ["2.weight", "2.bias"]},
    {"id": "batchnorm-eval-weight", "module": bn_net, "input_shape": (3, 2, 5, 5), "names": ["1.weight"]},
    {"id": "batchnorm-eval-weight-bias", "module": bn_net, "input_shape": (3, 2, 5, 5),
     "names": ["1.weight", "1.bias", "0.weight"]},
    {"id": "batchnorm-train-weight", "module": bn_net, "input_shape": (3, 2, 5, 5), "names": ["1.weight", "0.bias"],
     "train": True},
    {"id": "embedding-weight", "module": Looked, "input_shape": (3, 4), "names": ["emb.weight"]},
    {"id": "embedding-padding-freq", "module": lambda: Looked(padding_idx=2, scale_grad_by_freq=True),
     "input_shape": (3, 4), "names": ["emb.weight"]},
    {"id": "matmul-param", "module": Bilinear, "input_shape": (3, 4), "names": ["W"]},
    {"id": "scale-param", "module": Bilinear, "input_shape": (3, 4), "names": ["scale"]},
    {"id": "0-dim-param", "module": Bilinear, "input_shape": (3, 4), "names": ["gain"]},
    {"id": "all-direct-params", "module": Bilinear, "input_shape": (3, 4), "names": ["W", "scale", "gain"]},
    {"id": "tied-transposed", "module": Tied, "input_shape": (3, 4), "names": ["enc.weight"]},
    {"id": "tied-same-layer-twice", "module": TiedSame, "input_shape": (3, 4), "names": ["lin.weight", "lin.bias"]},
    {"id": "shared-parameter-object", "module": SharedParameter, "input_shape": (3, 4), "names": ["a.weight"]},
]


def param_reference(model, x, names, param_dirs, u, train):
    """d/dt model(x + t u; W + t U) at t = 0, by torch.func.jvp (forward_ad in train mode)."""
    params = [dict(model.named_parameters())[n] for n in names]
    if not train:
        def f(x_, *ps):
            return functional_call(model, dict(zip(names, ps)), (x_,))

        primals = (x, *params)
        tangents = (u if u is not None else torch.zeros_like(x), *param_dirs)
        return torch.func.jvp(f, primals, tangents)
    with fwAD.dual_level():
        duals = {n: fwAD.make_dual(p.detach(), d) for n, p, d in zip(names, params, param_dirs)}
        xd = fwAD.make_dual(x, u) if u is not None else x
        out = functional_call(model, duals, (xd,))
        p, t = fwAD.unpack_dual(out)
        return p, t


@pytest.mark.parametrize("with_input_tangent", [False, True], ids=["params-only", "params-and-input"])
@pytest.mark.parametrize("setting", PARAM_SETTINGS, ids=[s["id"] for s in PARAM_SETTINGS])
def test_jvp_params(setting, with_input_tangent):
    torch.manual_seed(0)
    model = setting["module"]().to(D).train(setting.get("train", False))
    model_ref = copy.deepcopy(model)
    x = randn(*setting["input_shape"])
    u = randn(*setting["input_shape"]) if with_input_tangent else None
    named = dict(model.named_parameters())
    dirs = {n: torch.randn_like(named[n]) for n in setting["names"]}
    with fallback_mode("error"):
        y, t = jvpreg.jvp_params(model, (x,), dirs, None if u is None else (u,))
    y_ref, t_ref = param_reference(model_ref, x, setting["names"], [dirs[n] for n in setting["names"]], u,
                                   setting.get("train", False))
    torch.testing.assert_close(y.detach(), y_ref.detach(), rtol=RTOL, atol=1e-13)
    torch.testing.assert_close(t.detach(), t_ref.detach(), rtol=RTOL, atol=RTOL * t_ref.abs().max().item())
    for (n, b), (_, b_ref) in zip(model.named_buffers(), model_ref.named_buffers()):
        torch.testing.assert_close(b, b_ref, rtol=1e-12, atol=1e-12, msg=lambda m: f"buffer {n}: {m}")
    assert all(type(p) is nn.Parameter for p in model.parameters())


@pytest.mark.parametrize("engine", ["eager", "captured"])
@pytest.mark.parametrize("embedding", [{}, {"padding_idx": 2, "scale_grad_by_freq": True}], ids=["plain", "padding-freq"])
def test_embedding_weight_direction_gradients(embedding, engine):
    """The lookup of a weight direction keeps a plain lookup's backward (no gradient into ``padding_idx``'s row,
    gradients scaled by index frequency): the gradient of ``||J_W U||^2`` is torch.func's."""
    torch.manual_seed(0)
    model = Looked(**embedding).to(D)
    x, U = randn(3, 4), torch.randn(6, 4, dtype=D)
    weight = model.emb.weight

    def reference(w):
        return torch.func.jvp(lambda w_: functional_call(model, {"emb.weight": w_}, (x,)), (w,), (U,))[1]

    want = torch.autograd.grad(reference(weight).square().sum(), weight)[0]
    with fallback_mode("error"):
        for _ in range(2):
            _, t = jvpreg.jvp_params(model, (x,), {"emb.weight": U}, engine=engine)
    got = torch.autograd.grad(t.square().sum(), weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    if "padding_idx" in embedding:
        assert got[2].abs().max() == 0


def test_jvp_params_batched_equals_separate_calls():
    model = conv_net(2).to(D)
    x = randn(2, 2, 6, 6)
    W = model[0].weight
    Us = torch.randn(3, *W.shape, dtype=D)
    with fallback_mode("error"):
        y, ts = jvpreg.jvp_params(model, (x,), {"0.weight": Us}, batched_tangents=True)
        for j in range(3):
            y_j, t_j = jvpreg.jvp_params(model, (x,), {"0.weight": Us[j]})
            torch.testing.assert_close(y, y_j, rtol=0, atol=0)
            torch.testing.assert_close(ts[j], t_j, rtol=RTOL, atol=1e-14)


@pytest.mark.parametrize("engine", ["eager", pytest.param("captured", marks=pytest.mark.slow)])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_jvp_params_several_tangents_through_a_transformer_block(train, engine):
    """k = 3 directions of every weight (LayerNorms included) and of a 3-d input through a pre-norm encoder
    block: each block j is torch.func's JVP along (u_j, U_j). The math attention kernel gives the reference."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
    model = nn.Sequential(nn.Linear(6, 16), layer, nn.Flatten(), nn.Linear(80, 3)).to(D).train(train)
    x, k = randn(4, 5, 6), 3
    params = dict(model.named_parameters())
    dirs = {n: torch.randn(k, *p.shape, dtype=D) for n, p in params.items()}
    u = torch.randn(k, *x.shape, dtype=D)
    with fallback_mode("error"):
        y, ts = jvpreg.jvp_params(model, (x,), dirs, (u,), batched_tangents=True, engine=engine)

    def f(x_, *ps):
        return functional_call(model, dict(zip(dirs, ps)), (x_,))

    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # the fused eval kernel has no forward AD
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            want = torch.stack([torch.func.jvp(f, (x, *params.values()), (u[j], *(d[j] for d in dirs.values())))[1]
                                for j in range(k)])
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    torch.testing.assert_close(ts, want, rtol=RTOL, atol=RTOL * want.abs().max().item())


def test_jvp_params_has_aux_and_kwargs():
    class WithKwargs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, *, power):
            y = self.lin(x) ** power
            return y, y.sum()

    model = WithKwargs().to(D)
    x = randn(3, 4)
    U = torch.randn_like(model.lin.weight)
    y, t, aux = jvpreg.jvp_params(model, (x,), {"lin.weight": U}, kwargs={"power": 2}, has_aux=True)

    def f(w):
        return functional_call(model, {"lin.weight": w}, (x,), {"power": 2})

    y_ref, t_ref, aux_ref = torch.func.jvp(f, (model.lin.weight.detach(),), (U,), has_aux=True)
    torch.testing.assert_close(t, t_ref, rtol=RTOL, atol=1e-13)
    torch.testing.assert_close(aux, aux_ref, rtol=1e-12, atol=0)


PARAM_ERRORS = [
    {"id": "unknown-name-with-suggestion", "names": {"0.weigth": (6, 4)}, "error": ValueError,
     "match": WHERE_P + r"module has no parameter '0\.weigth'\. Did you mean '0\.weight'"},
    {"id": "unknown-name-no-suggestion", "names": {"encoder.conv": (6, 4)}, "error": ValueError,
     "match": WHERE_P + r"module has no parameter 'encoder\.conv'\.$"},
    {"id": "direction-shape", "names": {"0.weight": (4, 6)}, "error": ValueError,
     "match": WHERE_P + r"direction for '0\.weight' has shape \(4, 6\), expected \(6, 4\)\.$"},
    {"id": "empty-dict", "names": {}, "error": TypeError,
     "match": WHERE_P + "expected param_tangents to be a non-empty dict name -> tensor"},
]


@pytest.mark.parametrize("case", PARAM_ERRORS, ids=[c["id"] for c in PARAM_ERRORS])
def test_jvp_params_validation_errors(case):
    model = mlp()
    dirs = {n: torch.zeros(shape, dtype=D) for n, shape in case["names"].items()}
    with pytest.raises(case["error"], match=case["match"]):
        jvpreg.jvp_params(model, (randn(3, 4),), dirs)


def test_jvp_params_other_errors():
    model = mlp()
    x = randn(3, 4)
    ok = {"0.weight": torch.zeros(6, 4, dtype=D)}
    with pytest.raises(TypeError, match=WHERE_P + "expected an nn.Module, got function"):
        jvpreg.jvp_params(lambda z: z, (x,), ok)
    with pytest.raises(TypeError, match=WHERE_P + "expected primals to be a tuple of tensors, got Tensor"):
        jvpreg.jvp_params(model, x, ok)
    with pytest.raises(ValueError, match=WHERE_P + "expected one tangent per primal, got 2 for 1"):
        jvpreg.jvp_params(model, (x,), ok, (x, x))
    with pytest.raises(ValueError, match=WHERE_P + r"direction for '0\.weight' is torch\.float32 on cpu, the parameter "
                                                   r"torch\.float64 on cpu: they must share dtype and device"):
        jvpreg.jvp_params(model, (x,), {"0.weight": torch.zeros(6, 4)})
    with pytest.raises(ValueError, match=WHERE_P + r"direction for '0\.weight' holds no direction \(k = 0\)"):
        jvpreg.jvp_params(model, (x,), {"0.weight": torch.zeros(0, 6, 4, dtype=D)}, batched_tangents=True)
    with pytest.raises(ValueError, match=WHERE_P + r"every direction must carry the same number of tangents k, "
                                                   r"got \[2, 3\]"):
        jvpreg.jvp_params(model, (x,), {"0.weight": torch.zeros(2, 6, 4, dtype=D)}, (torch.zeros(3, 3, 4, dtype=D),),
                          batched_tangents=True)


class ShortcutIntoPlain(nn.Module):
    """ResNeSt-style residual: ``x += shortcut(x)`` written in place into the main path's tensor."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.down = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(3, 4, 1)

    def forward(self, x):
        out = self.bn(self.conv(x))
        out += self.down(x)
        return torch.relu(out)


def test_jvp_params_inplace_residual_into_the_plain_prefix():
    """Perturbing the shortcut's weight: the in-place residual add lands in a tensor computed before any perturbed
    layer; jvp_params reruns with clone inputs, running statistics updated once (as one plain forward)."""
    torch.manual_seed(0)
    model = ShortcutIntoPlain().double().train()
    plain = copy.deepcopy(model)
    x, U = torch.randn(2, 3, 5, 5, dtype=D), torch.randn(4, 3, 1, 1, dtype=D)
    y, t = jvpreg.jvp_params(model, (x,), {"down.weight": U})
    params = {n: p.detach() for n, p in plain.named_parameters()}
    ry, rt = torch.func.jvp(lambda w: torch.func.functional_call(copy.deepcopy(plain), {**params, "down.weight": w},
                                                                 (x,)), (params["down.weight"],), (U,))
    assert_tree_close((y, t), (ry, rt))
    plain(x)
    for b, b_plain in zip(model.buffers(), plain.buffers()):
        assert torch.equal(b, b_plain)


@pytest.mark.parametrize("module", [lambda: nn.LayerNorm(5), lambda: nn.GroupNorm(2, 6)], ids=["layer_norm", "group_norm"])
def test_jvp_params_norm_weights_use_rules_not_the_fallback(module):
    """Differentiated norm weights on a plain input: the rule (xhat * dgamma + dbeta), exact, no fallback."""
    from jvpreg.clone.eager.dispatch import record_fallbacks

    torch.manual_seed(0)
    mod, x = module().double(), torch.randn(4, 6, 5, dtype=D)
    U = torch.randn_like(mod.weight)
    with record_fallbacks() as seen:
        got = jvpreg.jvp_params(mod, (x,), {"weight": U})
    want = torch.func.jvp(lambda w: torch.func.functional_call(mod, {"weight": w, "bias": mod.bias}, (x,)),
                          (mod.weight.detach(),), (U,))
    assert_tree_close(got, want)
    assert seen == []


def test_rule_for_returns_the_rule_function_itself():
    from jvpreg.clone.rules import cpa, composite

    assert jvpreg.clone.rule_for(torch.relu) is cpa.relu
    assert jvpreg.clone.rule_for(torch.logsumexp) is composite.logsumexp
    assert jvpreg.clone.rule_for(torch.narrow).__name__ == "_narrow"
    assert jvpreg.clone.rule_for(torch.special.zeta) is None  # generic path: fallback


def test_inside_vmap_a_clear_error_points_to_batched_tangents_which_gives_the_same_jvps():
    """Under torch.func.vmap clone mode cannot read the tangents' values (it failed deep inside the scale choice
    with "Cannot access data pointer of Tensor that doesn't have storage"): a clear error says what to do, and
    doing it gives torch.func's vmapped JVPs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, U = torch.randn(2, 4, dtype=D), torch.randn(6, 2, 4, dtype=D)
    with pytest.raises(RuntimeError, match="batched_tangents=True"):
        torch.func.vmap(lambda u: jvpreg.jvp(model, (x,), (u,))[1])(U)
    with pytest.raises(RuntimeError, match="cannot run inside torch.func.vmap"):
        torch.func.vmap(lambda u: jvpreg.jvp_params(model, (x,), {"0.weight": u})[1])(torch.randn(2, 5, 4, dtype=D))
    _, got = jvpreg.jvp(model, (x,), (U,), batched_tangents=True)
    want = torch.func.vmap(lambda u: torch.func.jvp(model, (x,), (u,))[1])(U)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("engine", ["eager", "captured"])
def test_float32_jvp_where_the_output_barely_moves_with_the_input(engine):
    """``|f(x)| / |J u|`` ~ 3e10 (a random-init ConvMixer's is 1e11): the difference form's rounding
    ``eps |y_0| / |s J u|`` stays below torch.func's own float32 error (with the former R = 2^20: 5e-4)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).double()
    with torch.no_grad():
        net[2].weight.mul_(1e-7)
        net[2].bias.fill_(1e3)
    x, u = torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    y, truth = torch.func.jvp(net, (x,), (u,))
    assert y.norm() / truth.norm() > 1e10
    net.float()
    err = lambda t: float((t.double() - truth).norm() / truth.norm())  # noqa: E731
    theirs = err(torch.func.jvp(net, (x.float(),), (u.float(),))[1])
    ours = err(jvpreg.jvp(net, (x.float(),), (u.float(),), engine=engine)[1])
    assert ours <= 10 * theirs + 1e-7, (ours, theirs)
