"""Never a silently wrong result: unsupported ops, the exact fallback, writes outside the batch,
float32/bf16 precision on whole networks, and running statistics in train mode.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn

import jvpreg
from conftest import count_captures, runs_engine
from jvpreg.clone.eager import dispatch
from jvpreg.clone import fallback_mode, set_fallback
from jvpreg.clone.core.registry import HANDLERS
from jvpreg.models import build_model
from conftest import assert_as_plain

D = torch.float64


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The fallback warns once per op and process; start from a clean slate."""
    monkeypatch.setattr(dispatch, "WARNED_FALLBACKS", set())


# ----------------------------------------------------------------------------- (a) ops without rule or formula


@torch.library.custom_op("jvpreg_test::scaled_sin", mutates_args=())
def scaled_sin(x: torch.Tensor) -> torch.Tensor:
    """A custom op with no autograd registration: no forward-mode formula."""
    return 2 * x.sin()


@torch.library.custom_op("jvpreg_test::soft_threshold", mutates_args=())
def soft_threshold(x: torch.Tensor, lam: float) -> torch.Tensor:
    return x.sign() * (x.abs() - lam).clamp_min(0)


class ExpOldStyle(torch.autograd.Function):
    """forward(ctx, ...) without setup_context: torch.func cannot transform it."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class ExpNoJvp(torch.autograd.Function):
    """setup_context style, backward only: no jvp staticmethod."""

    @staticmethod
    def forward(x):
        return x.exp()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class ExpWithJvp(ExpNoJvp):
    @staticmethod
    def jvp(ctx, x_t):
        (y,) = ctx.saved_tensors
        return x_t * y


X = torch.randn(3, 4, dtype=D)
U = torch.randn(3, 4, dtype=D)


@pytest.mark.parametrize("mode", ["jvp", "error"])
def test_custom_op_without_autograd_raises(mode):
    with fallback_mode(mode), pytest.raises(jvpreg.UnsupportedOpError,
                                            match=r"scaled_sin(.|\n)*register_rule"):
        jvpreg.jvp(lambda x: scaled_sin(x) + x, (X,), (U,))


HINT_SETTINGS = [
    {"id": "torch-function", "func": torch.atan, "key": "torch.atan"},
    {"id": "tensor-method", "func": lambda x: x.erf(), "key": "torch.Tensor.erf"},
    {"id": "custom-op", "func": scaled_sin, "key": "torch.ops.jvpreg_test.scaled_sin.default"},
]


@pytest.mark.parametrize("setting", [
    pytest.param(s, id=s["id"], marks=pytest.mark.xfail(reason="engine bug: " + s["xfail"], strict=True))
    if "xfail" in s else pytest.param(s, id=s["id"]) for s in HINT_SETTINGS
])
def test_error_hint_names_a_registrable_key(setting):
    """The hint must be copy-pasteable: the expression it names is the key the registry looks up."""
    with fallback_mode("error"), pytest.raises(jvpreg.UnsupportedOpError) as info:
        jvpreg.jvp(setting["func"], (X,), (U,))
    assert f"register_rule({setting['key']})" in str(info.value)


@pytest.mark.parametrize("function", [ExpOldStyle, ExpNoJvp], ids=["old-style", "no-jvp"])
def test_autograd_function_without_jvp_raises(function):
    with pytest.raises(jvpreg.UnsupportedOpError,
                       match=rf"no rule for .*{function.__name__}\.apply(.|\n)*Register a clone rule"):
        jvpreg.jvp(lambda x: function.apply(x) * 2, (X,), (U,))


def test_autograd_function_error_names_register_function_rule():
    with pytest.raises(jvpreg.UnsupportedOpError, match="register_function_rule"):
        jvpreg.jvp(lambda x: ExpNoJvp.apply(x), (X,), (U,))


EXP_APPLY = ExpNoJvp.apply  # bound before any clone forward: torch's own apply, not jvpreg's routing


def test_custom_function_bound_before_the_forward_is_refused_under_autograd():
    """Its forward runs op by op through the rules, but its backward would see blocks as samples."""
    x = X.clone().requires_grad_(True)
    with pytest.raises(jvpreg.UnsupportedOpError, match=r"ExpNoJvp(.|\n)*taken before the clone forward"):
        jvpreg.jvp(lambda x: EXP_APPLY(x) * 2, (x,), (U,))
    with pytest.raises(jvpreg.UnsupportedOpError, match="taken before the clone forward"):
        jvpreg.jvp(EXP_APPLY, (x,), (U,))  # the custom output is the result itself


def test_custom_function_bound_before_the_forward_is_exact_without_autograd():
    """No backward is built: the forward ran through the rules, so the JVP is exact."""
    y, t = jvpreg.jvp(lambda x: EXP_APPLY(x) * 2, (X,), (U,))
    torch.testing.assert_close(t, 2 * X.exp() * U, rtol=1e-12, atol=0)
    torch.testing.assert_close(y, 2 * X.exp(), rtol=0, atol=0)


def test_function_apply_is_restored_outside_a_clone_forward():
    """No global torch state changes outside an active clone forward (routing lives in `call`)."""
    orig = torch.autograd.Function.__dict__["apply"]
    seen = []

    def f(x):
        seen.append(torch.autograd.Function.__dict__["apply"])
        return ExpWithJvp.apply(x)

    with pytest.warns(jvpreg.JVPFallbackWarning):
        jvpreg.jvp(f, (X,), (U,))
    assert seen and seen[0] is not orig
    assert torch.autograd.Function.__dict__["apply"] is orig


def test_clone_batch_outside_a_clone_forward_is_refused():
    (cx,), _ = jvpreg.clone.pack((X,), (U[None],))
    with pytest.raises(RuntimeError, match=r"outside a clone forward(.|\n)*jvpreg.clone.call"):
        cx.exp()
    out, tan = jvpreg.clone.unpack(jvpreg.clone.call(torch.exp, (cx,)), _)
    torch.testing.assert_close(tan[0], X.exp() * U, rtol=1e-12, atol=0)


def test_autograd_function_with_jvp_uses_exact_fallback(fresh_warnings):
    with pytest.warns(jvpreg.JVPFallbackWarning, match="ExpWithJvp"):
        y, t = jvpreg.jvp(lambda x: ExpWithJvp.apply(x).sum(1), (X,), (U,))
    torch.testing.assert_close(t, (X.exp() * U).sum(1), rtol=1e-10, atol=0)


def test_registered_rules_for_custom_op_and_function_are_used():
    """The two extension points the error messages advertise, end to end (registry docstring example)."""
    op = torch.ops.jvpreg_test.soft_threshold.default

    def soft_threshold_rule(x, lam):
        a, b = x[0], x[1:]
        keep = a.abs() > lam
        out_a = op(a, lam)
        return torch.cat([out_a[None], torch.where(keep, b - lam * a.sign(), out_a)])

    def exp_rule(args, kwargs):
        from jvpreg.clone.core.tensor import wrap

        (x,) = args
        a = x[0]
        return wrap(torch.cat([a.exp()[None], a.exp() * (1 + x[1:] - a)]))

    jvpreg.clone.register_rule(op)(soft_threshold_rule)
    jvpreg.clone.register_function_rule(ExpOldStyle)(exp_rule)
    try:
        with fallback_mode("error"):
            y, t = jvpreg.jvp(lambda x: soft_threshold(x, 0.5) + ExpOldStyle.apply(x), (X,), (U,))
    finally:
        HANDLERS.pop(op)
        jvpreg.clone.eager.functions.FUNCTION_RULES.pop(ExpOldStyle)
    keep = X.abs() > 0.5
    torch.testing.assert_close(y, soft_threshold(X, 0.5) + X.exp(), rtol=1e-12, atol=0)
    torch.testing.assert_close(t, keep * U + X.exp() * U, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- (b) the exact fallback

# "name": how the messages must name the op (test_error_hint_names_a_registrable_key pins the exact form)
FALLBACK_SETTINGS = [
    {"id": "atan", "func": torch.atan, "name": r"torch\.\S*atan"},
    {"id": "erf", "func": torch.erf, "name": r"torch\.\S*erf"},
    {"id": "erf-method", "func": lambda x: x.erf(), "name": r"torch\.Tensor\.erf"},
    {"id": "cosh-in-a-net", "func": lambda x: torch.cosh(x.relu() * 0.5).sum(1), "name": r"torch\.\S*cosh"},
]


@pytest.mark.parametrize("setting", FALLBACK_SETTINGS, ids=[s["id"] for s in FALLBACK_SETTINGS])
def test_fallback_is_exact_and_warns(setting, fresh_warnings):
    with pytest.warns(jvpreg.JVPFallbackWarning, match=setting["name"] + ".*exact torch.func.jvp fallback"):
        y, t = jvpreg.jvp(setting["func"], (X,), (U,))
    y_ref, t_ref = torch.func.jvp(setting["func"], (X,), (U,))
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)


def test_fallback_with_several_tangents():
    us = torch.randn(3, *X.shape, dtype=D)
    y, ts = jvpreg.jvp(lambda x: torch.atan(x) * x.erf(), (X,), (us,), batched_tangents=True)
    for j in range(3):
        torch.testing.assert_close(ts[j], torch.func.jvp(lambda x: torch.atan(x) * x.erf(), (X,), (us[j],))[1],
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_fallback_differentiates_along_a_tangent_of_the_primals_size(dtype, rtol, fresh_warnings):
    """The fallback hands torch.func.jvp the block difference rescaled by a power of two to the primal's size, not
    ``s u`` (s ~ 2^20 rms(x) / rms(u) then): matrix_exp's forward-mode formula (the exponential of [[X, D], [0, X]]) follows ||D||, and
    along ``s u`` its float32 JVP was 23% off (float64: 4e-9)."""
    torch.manual_seed(0)
    x, u = torch.randn(5, 5, dtype=dtype) * 4, torch.randn(5, 5, dtype=dtype)
    with pytest.warns(jvpreg.JVPFallbackWarning, match="matrix_exp"):
        _, t = jvpreg.jvp(torch.linalg.matrix_exp, (x,), (u,))
    _, want = torch.func.jvp(torch.linalg.matrix_exp, (x.double(),), (u.double(),))
    torch.testing.assert_close(t.double(), want, rtol=rtol, atol=rtol * want.abs().max().item())


@pytest.mark.parametrize("setting", FALLBACK_SETTINGS, ids=[s["id"] for s in FALLBACK_SETTINGS])
def test_fallback_disabled_raises(setting):
    with fallback_mode("error"), pytest.raises(
            jvpreg.UnsupportedOpError,
            match=f"no rule for {setting['name']} and the fallback is disabled "
                  r"\(jvpreg\.clone\.set_fallback\('error'\)\)\. Register a clone rule"):
        jvpreg.jvp(setting["func"], (X,), (U,))


def test_set_fallback_global_switch_and_validation():
    set_fallback("error")
    try:
        with pytest.raises(jvpreg.UnsupportedOpError):
            jvpreg.jvp(torch.atan, (X,), (U,))
    finally:
        set_fallback("jvp")
    jvpreg.jvp(torch.atan, (X,), (U,))
    with pytest.raises(ValueError, match=r"set_fallback\(mode\): expected 'jvp' or 'error', got 'warn'"):
        set_fallback("warn")
    with pytest.raises(ValueError, match="got 'off'"), fallback_mode("off"):
        pass


def test_fallback_mode_restores_on_error():
    with pytest.raises(RuntimeError), fallback_mode("error"):
        raise RuntimeError("boom")
    jvpreg.jvp(torch.atan, (X,), (U,))  # back to "jvp": no error


# ----------------------------------------------------------------------------- (c) writes outside the batch

OUTSIDE = "created outside the batch"


# Writes of batch data into a tensor the forward did not make (a cache or buffer made before it): a plain tensor
# cannot hold the blocks. (Tensors the forward makes itself are filled: tests/clone/test_made_tensors.py.)


def write_setitem(h, buf):
    buf[:, 0] = h[:, 0]
    return buf


def write_copy(h, buf):
    buf.copy_(h)
    return buf


def write_add_(h, buf):
    buf.add_(h)
    return buf


def write_iadd(h, buf):
    buf += h
    return buf


def write_mul_(h, buf):
    buf.mul_(h)
    return buf


def write_masked_setitem(h, buf):
    buf[h > 0] = h[h > 0]
    return buf


WRITE_SETTINGS = [
    {"id": "setitem", "func": write_setitem, "error": RuntimeError, "match": r"`t\[\.\.\.\] = h` writes batch data "
     r"into a tensor created outside the batch\. Create `t` from the batch \(e\.g\. torch\.zeros_like\(h\)"},
    {"id": "masked-setitem", "func": write_masked_setitem, "error": RuntimeError, "match": OUTSIDE},
    {"id": "copy_", "func": write_copy, "error": RuntimeError, "match": r"`t\.copy_\(h\)` .*" + OUTSIDE},
    {"id": "add_", "func": write_add_, "error": RuntimeError, "match": "add_ would write batch data into a tensor "
                                                                      + OUTSIDE},
    {"id": "iadd", "func": write_iadd, "error": RuntimeError, "match": OUTSIDE},
    {"id": "mul_", "func": write_mul_, "error": RuntimeError, "match": OUTSIDE},
    {"id": "out-kwarg-no-rule", "func": lambda h, buf: torch.atan(h, out=torch.empty(h.shape, dtype=h.dtype)),
     "error": jvpreg.UnsupportedOpError, "match": r"atan\(\.\.\., out=\.\.\.\) is not supported; use the "
                                                  r"out-of-place form"},
    {"id": "out-kwarg-with-rule", "func": lambda h, buf: torch.sin(h, out=torch.empty(h.shape, dtype=h.dtype)),
     "error": jvpreg.UnsupportedOpError, "match": r"sin\(\.\.\., out=\.\.\.\) is not supported"},
]


@pytest.mark.parametrize("setting", [
    pytest.param(s, id=s["id"], marks=pytest.mark.xfail(reason="engine bug: " + s["xfail"], strict=True))
    if "xfail" in s else pytest.param(s, id=s["id"]) for s in WRITE_SETTINGS
])
def test_write_into_plain_buffer_raises(setting):
    buf = torch.ones(X.shape, dtype=X.dtype)  # made before the forward
    with pytest.raises(setting["error"], match=setting["match"]):
        jvpreg.jvp(lambda x: setting["func"](torch.tanh(x), buf), (X,), (U,))
    assert torch.equal(buf, torch.ones(X.shape, dtype=X.dtype)) and type(buf) is torch.Tensor


def test_write_into_a_cache_says_use_cache_false():
    """Hugging Face's Mamba (use_cache=True) copies its convolution state into a cache made before the forward."""
    cache = torch.zeros(X.shape, dtype=X.dtype)

    def f(x):
        cache.copy_(x)
        return x.sin()

    with pytest.raises(jvpreg.UnsupportedOpError, match=OUTSIDE + ".*use_cache=False"):
        jvpreg.jvp(f, (X,), (U,))


STATE_WRITES = {  # a buffer written from detached batch data: the same in every block, so its primal is written
    "add_": lambda buf, h: buf.mul_(0.9).add_(0.1 * h.detach().mean(0)),
    "copy_": lambda buf, h: buf.copy_(0.9 * buf + 0.1 * h.detach().mean(0)),
    "setitem": lambda buf, h: buf.__setitem__(slice(None), h.detach().mean(0)),
    "mul_": lambda buf, h: buf.mul_(0.5 * h.detach().mean(0) + 1),
    "iadd": lambda buf, h: buf.__iadd__(h.detach().mean(0)),
}


class Statistic(torch.nn.Module):
    """An EMA buffer updated in the forward from detached batch data, then read by the same forward."""

    def __init__(self, write):
        super().__init__()
        self.lin, self.write = torch.nn.Linear(4, 4).to(D), write
        self.register_buffer("ema", torch.zeros(4, dtype=D))

    def forward(self, x):
        h = self.lin(x)
        self.write(self.ema, h)
        return torch.tanh(h - self.ema)


@pytest.mark.parametrize("engine", ["eager", "auto", "captured"])
@pytest.mark.parametrize("write", list(STATE_WRITES))
def test_a_buffer_written_from_detached_batch_data_is_written_as_a_plain_forward_writes_it(write, engine):
    """Buffer and output equal a plain forward's after each call (3 calls); the JVP equals torch.func.jvp's with the
    written buffer as a constant (what a plain forward reads after the write)."""
    import copy

    torch.manual_seed(0)
    model = Statistic(STATE_WRITES[write])
    plain = copy.deepcopy(model)
    x, u = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    for _ in range(3):
        want_out = plain(x)
        out, tangent = jvpreg.jvp(model, (x,), (u,), engine=engine)
        assert_as_plain(model.ema, plain.ema, "ema")
        assert_as_plain(out, want_out, "output")
        ema = plain.ema.clone()
        want = torch.func.jvp(lambda a: torch.tanh(model.lin(a) - ema), (x,), (u,))[1]
        torch.testing.assert_close(tangent, want, rtol=1e-12, atol=1e-14)


def test_a_buffer_written_from_batch_data_that_carries_a_tangent_says_detach():
    model = Statistic(lambda buf, h: buf.add_(h.mean(0)))
    with pytest.raises(jvpreg.UnsupportedOpError, match=r"from detached batch data \(h\.detach\(\)\)"):
        jvpreg.jvp(model, (X[:, :4],), (U[:, :4],))


# ----------------------------------------------------------------------------- (d) float32 precision on networks

# Train mode at 32x32: the last BatchNorms see (batch x 1 x 1) values per channel, which makes the JVP
# intrinsically ill-conditioned in float32 -- float32 forward AD itself misses 1e-5 (batch 4: resnet18 4e-5,
# efficientnet_b0 8e-4, densenet121 1e-3, inception_v3 8e-2; batch 2: up to 7e3). For those networks
# ("yardstick") the train-mode bound is 1.5x the error of torch's own float32 forward-mode JVP.
NETWORKS = [
    {"name": "resnet18", "size": 32, "yardstick": True},
    {"name": "vgg11_bn", "size": 32, "yardstick": False},
    {"name": "densenet121", "size": 32, "yardstick": True},
    {"name": "efficientnet_b0", "size": 32, "yardstick": True},
    {"name": "inception_v3", "size": 75, "yardstick": True},
    {"name": "rnn", "size": 32, "yardstick": False},
    {"name": "unet", "size": 32, "yardstick": False},
]
EVAL_BATCH, TRAIN_BATCH = 1, 4


def _network(name: str, size: int, train: bool) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(name, in_channels=3, num_classes=10, image_size=size).train(train)
    for m in model.modules():  # random masks would differ between the runs; dropout is tested in test_rules
        if isinstance(m, nn.Dropout) or type(m).__name__ == "StochasticDepth":
            m.eval()
    return model


def _forward_ad(model, x, u):
    with fwAD.dual_level():
        y, t = fwAD.unpack_dual(model(fwAD.make_dual(x, u)))
    return y.detach(), t.detach()


def _without_running_stats(model: nn.Module) -> nn.Module:
    """A copy whose train-mode BatchNorms keep no running statistics: the same function of the batch, and one
    that torch.func.jvp can transform (about 2x faster than forward AD on these CPU float64 networks)."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None
    return model


@pytest.mark.slow
@pytest.mark.parametrize("net", [pytest.param(n, id=n["name"]) for n in NETWORKS])
def test_float32_precision_eval(net):
    """Eval mode: float32 clone JVP within 1e-5 (norm-wise) of the float64 torch.func.jvp."""
    model = _network(net["name"], net["size"], train=False)
    model64 = copy.deepcopy(model).double()
    x = torch.randn(EVAL_BATCH, 3, net["size"], net["size"])
    u = torch.randn_like(x)
    with torch.no_grad():
        y, t = jvpreg.jvp(model, (x,), (u,))
        y_ref, t_ref = torch.func.jvp(model64, (x.double(),), (u.double(),))
    assert y.dtype == t.dtype == torch.float32
    assert rel_err(y, y_ref) <= 1e-5
    assert rel_err(t, t_ref) <= 1e-5, f"relative error {rel_err(t, t_ref):.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("net", NETWORKS, ids=[n["name"] for n in NETWORKS])
def test_float32_precision_train(net):
    """Train mode (clone-BN): float32 clone JVP within 1e-5 of float64 torch.func.jvp (or of the yardstick)."""
    model = _network(net["name"], net["size"], train=True)
    model32 = _without_running_stats(model)
    model64 = copy.deepcopy(model32).double()
    x = torch.randn(TRAIN_BATCH, 3, net["size"], net["size"])
    u = torch.randn_like(x)
    with torch.no_grad():
        y, t = jvpreg.jvp(model, (x,), (u,))
        y_ref, t_ref = torch.func.jvp(model64, (x.double(),), (u.double(),))
        bound = 1e-5
        if net["yardstick"]:
            bound = max(bound, 1.5 * rel_err(torch.func.jvp(model32, (x,), (u,))[1], t_ref))
    assert rel_err(t, t_ref) <= bound, f"relative error {rel_err(t, t_ref):.2e} > {bound:.2e}"


# ----------------------------------------------------------------------------- (e) running statistics


def bn_zoo():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
        nn.Conv2d(4, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True, affine=True), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 12 * 12, 6), nn.BatchNorm1d(6), nn.Tanh(),
    )


class LocalPatchInteraction(nn.Module):
    """XCiT's LPI: tokens -> channels-last image -> depthwise conv, GELU, BatchNorm, conv. The primal block must
    keep the channels-last layout of the plain forward, or BatchNorm's statistics differ in the last bits."""

    def __init__(self, c=32):
        super().__init__()
        self.conv1, self.act, self.bn = nn.Conv2d(c, c, 3, padding=1, groups=c), nn.GELU(), nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, groups=c)

    def forward(self, x):
        b, n, c = x.shape
        h = x.permute(0, 2, 1).reshape(b, c, 14, 14)
        return self.conv2(self.bn(self.act(self.conv1(h)))).reshape(b, c, n).permute(0, 2, 1)


class AttentionBN(nn.Module):
    """Attention between two batch tensors (matmul, einsum, bmm) followed by BatchNorm over the channels."""

    def __init__(self, e=64, t=49):
        super().__init__()
        self.qkv, self.bn = nn.Linear(e, 3 * e), nn.BatchNorm1d(e)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = (q @ k.transpose(-2, -1)).softmax(-1)
        o = torch.einsum("bij,bjd->bid", a, v) + torch.bmm(a, v)
        return self.bn(o.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("builder,steps,shape", [
    (LocalPatchInteraction, 2, (2, 196, 32)),
    (AttentionBN, 2, (4, 49, 64)),
], ids=["xcit-lpi-channels-last", "attention-bn"])
def test_running_statistics_equal_plain_forward_tokens(builder, steps, shape):
    """Token models: primal output and running statistics bit-identical to plain forwards."""
    torch.manual_seed(0)
    model = builder().train()
    plain = copy.deepcopy(model)
    for step in range(steps):
        x = torch.randn(shape)
        with torch.no_grad():
            y, _ = jvpreg.jvp(model, (x,), (torch.randn_like(x),))
            y_plain = plain(x)
        assert torch.equal(y, y_plain), f"step {step}: primal output differs from the plain forward"
    for (name, b), b_plain in zip(model.named_buffers(), plain.buffers()):
        assert torch.equal(b, b_plain), f"buffer {name} differs from the plain forward's"


@pytest.mark.parametrize("builder,steps", [
    (lambda: bn_zoo(), 2),
    (lambda: build_model("resnet18", in_channels=3, num_classes=10, image_size=16), 1),
], ids=["bn-momentum-None-instancenorm-bn1d", "resnet18"])
def test_running_statistics_equal_plain_forward(builder, steps):
    """Train-mode clone forwards update running_mean/var/num_batches_tracked exactly as plain forwards of the
    primal alone, and the primal output is bit-identical to the plain output."""
    torch.manual_seed(0)
    model = builder().train()
    plain = copy.deepcopy(model)
    for step in range(steps):
        x = torch.randn(4, 3, 16, 16)
        with torch.no_grad():
            y, _ = jvpreg.jvp(model, (x,), (torch.randn_like(x),))
            y_plain = plain(x)
        assert torch.equal(y, y_plain), f"step {step}: primal output differs from the plain forward"
    buffers = dict(plain.named_buffers())
    assert any(n.endswith("num_batches_tracked") for n in buffers)
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), f"buffer {name} differs from the plain forward's"


# ----------------------------------------------------------------------------- (f) bf16 autocast


def smooth_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.AvgPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.Tanh(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10),
    )


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_bf16_autocast_cpu(train):
    """Under CPU bf16 autocast the JVP is within bf16-size error (5e-2) of the float64 reference.

    A smooth CNN: with ReLU/max-pool the bf16 primal flips activation states and argmaxes, and even a
    float64 JVP of the same net with bf16-rounded weights is 2-7% off, so no bf16 JVP could meet 5e-2.
    """
    torch.manual_seed(0)
    model = smooth_cnn().train(train)
    model64 = copy.deepcopy(model).double()
    x = torch.randn(4, 3, 16, 16)
    u = torch.randn_like(x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y, t = jvpreg.jvp(model, (x,), (u,))
    with torch.no_grad():
        y_ref, t_ref = _forward_ad(model64, x.double(), u.double())
    assert t.dtype == torch.bfloat16
    assert math.isfinite(rel_err(t, t_ref))
    assert rel_err(y, y_ref) <= 5e-2
    assert rel_err(t, t_ref) <= 5e-2, f"relative error {rel_err(t, t_ref):.2e}"


@pytest.mark.parametrize("engine", ["eager", "captured"])
@pytest.mark.parametrize("module, shape", [(lambda: nn.BatchNorm2d(4), (1, 4, 1, 1)),
                                           (lambda: nn.BatchNorm1d(4), (1, 4)),
                                           (lambda: nn.GroupNorm(2, 2), (1, 2, 1))], ids=["bn2d", "bn1d", "groupnorm"])
def test_one_value_per_channel_in_training_raises_torchs_error(module, shape, engine):
    """A train-mode norm over one value per channel has no batch statistics: torch refuses it, and so does the clone
    forward (its rules replace the ``F.batch_norm`` / ``F.group_norm`` call that checks it)."""
    m = module().to(D).train()
    x = torch.randn(shape, dtype=D)
    with pytest.raises(ValueError) as theirs:
        m(x)
    with count_captures() as n, pytest.raises(ValueError) as ours:
        jvpreg.jvp(m, (x,), (torch.randn_like(x),), engine=engine)
    assert str(ours.value) == str(theirs.value)
    # captured: the error is raised while the forward is recorded (no eager run, no program)
    assert (n.raised, n.recorded, n.refused, n.eager, n.replays) == ((engine != "eager"), 0, 0, 0, 0), n


@pytest.mark.parametrize("pad", [lambda z: F.pad(z, (1, 1, 1, 1)), lambda z: torch.constant_pad_nd(z, (1, 1, 1, 1))])
def test_a_pad_longer_than_the_input_dims_raises_torchs_error(pad):
    """On the physical ``(K, n)`` tensor a 4-entry pad of a 1-D input would pad the block dim too, and once returned a
    ``(7,)`` output where torch refuses the call."""
    x, u = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    with pytest.raises(RuntimeError) as theirs:
        pad(x)
    with pytest.raises(RuntimeError) as ours:
        jvpreg.jvp(pad, (x,), (u,))
    assert str(ours.value) == str(theirs.value)


# ----------------------------------------------------------------------------- the reverse-mode fallback

def _double_vjp(f, x, u):
    """torch's own reverse-mode JVP (the double-backward trick), differentiable."""
    return torch.autograd.functional.jvp(f, (x,), (u,), create_graph=True)


def _penalty_gradient(run, f, x, u):
    xr = x.clone().requires_grad_()
    y, t = run(f, xr, u)
    return torch.autograd.grad(y.sum() + t.pow(2).sum(), xr)[0]


REVERSE_MODE_SETTINGS = [  # torch has no forward-mode formula for these (torch.func.jvp raises)
    {"id": "cdist", "func": lambda x: torch.cdist(x, torch.linspace(-1, 1, 12, dtype=D).reshape(4, 3) ** 3)},
    {"id": "index_reduce-mean", "func": lambda x: torch.zeros(2, 3, dtype=D).index_reduce(
        0, torch.tensor([0, 1, 0, 1, 1]), x[:, :3] if x.shape[0] == 5 else x, "mean", include_self=False)},
]


@pytest.mark.parametrize("setting", [pytest.param(s, id=s["id"]) for s in REVERSE_MODE_SETTINGS])
def test_ops_without_forward_mode_formula_take_the_reverse_mode_fallback(setting, fresh_warnings):
    """``J d = d/dv <J^T v, d>``: values and the penalty's gradient equal torch's own double-backward JVP."""
    f = setting["func"]
    g = torch.Generator().manual_seed(0)
    x, u = torch.randn(5, 3, generator=g, dtype=D), torch.randn(5, 3, generator=g, dtype=D)
    with pytest.raises(NotImplementedError, match="forward AD"):
        torch.func.jvp(f, (x,), (u,))
    try:
        y_ref, t_ref = _double_vjp(f, x, u)
    except (NotImplementedError, RuntimeError):  # torch 2.11: no double backward of cdist either
        with pytest.raises(jvpreg.UnsupportedOpError, match="reverse mode"):
            jvpreg.jvp(f, (x,), (u,))
        return
    with pytest.warns(dispatch.JVPFallbackWarning, match="reverse-mode"):
        y, t = jvpreg.jvp(f, (x,), (u,))
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-10)
    ours = _penalty_gradient(lambda f, x, u: jvpreg.jvp(f, (x,), (u,)), f, x, u)
    torch.testing.assert_close(ours, _penalty_gradient(_double_vjp, f, x, u), rtol=1e-8, atol=1e-10)


def test_scatter_reduce_prod_is_exact_where_torchs_forward_mode_formula_is_wrong():
    """torch.func.jvp of ``scatter_reduce(..., "prod")`` is wrong (its OpInfo marks it unsupported); an entry with
    ``include_self=False`` that receives a value no longer depends on ``x``: tangent 0 there, ``u`` elsewhere."""
    g = torch.Generator().manual_seed(0)
    x, u = torch.randn(10, 5, generator=g, dtype=D), torch.randn(10, 5, generator=g, dtype=D)
    src, idx = torch.randn(5, 5, generator=g, dtype=D), torch.randint(0, 10, (5, 5), generator=g)
    hit = torch.zeros(10, 5, dtype=torch.bool).scatter_(0, idx, True)
    want = torch.where(hit, 0.0, u)
    f = lambda z: z.scatter_reduce(0, idx, src, "prod", include_self=False)
    assert not torch.allclose(torch.func.jvp(f, (x,), (u,))[1], want)  # torch's forward mode
    for h in (f, lambda z: z.clone().scatter_reduce_(0, idx, src, "prod", include_self=False)):
        torch.testing.assert_close(jvpreg.jvp(h, (x,), (u,))[1], want, rtol=0, atol=1e-14)


def test_an_op_whose_backward_is_not_differentiable_is_refused(fresh_warnings):
    """No forward-mode formula and a backward without a graph: reverse mode cannot take the JVP, so a clear error
    (not the zero tangent that a ``J^T v`` taken at ``v = 0`` would give)."""
    lib = torch.library.Library("jvpreg_test_rev", "FRAGMENT")
    lib.define("cube(Tensor x) -> Tensor")
    lib.impl("cube", lambda x: x ** 3, "CompositeExplicitAutograd")

    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            return grad * 3 * x ** 2

    torch.library.register_autograd("jvpreg_test_rev::cube", backward,
                                    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))
    with pytest.raises(jvpreg.UnsupportedOpError, match="not differentiable"):
        jvpreg.jvp(lambda x: torch.ops.jvpreg_test_rev.cube(x), (X,), (U,))


def test_a_cast_to_float16_that_overflows_the_tangent_blocks_raises():
    """float32 input, a float16 cast inside: the blocks ``x + s u`` (s chosen for float32) overflow float16; a clear
    error, not an infinite tangent. From float16 inputs the scale fits and the JVP is float16's best: within one
    float16 rounding of the output's largest entry (the blocks ``x + s u`` are rounded; an entry of ``u`` near zero
    is off by that absolute amount, not relatively)."""
    torch.manual_seed(0)
    f = lambda x: (x.half() * 2).float()
    for _ in range(20):
        x, u = torch.randn(3, 4), torch.randn(3, 4)
        with pytest.raises(jvpreg.UnsupportedOpError, match="float16"):
            jvpreg.jvp(f, (x,), (u,))
        _, t = jvpreg.jvp(lambda x: x.half() * 2, (x.half(),), (u.half(),))
        want = (u.half() * 2).float()
        assert t.dtype == torch.float16
        torch.testing.assert_close(t.float(), want, rtol=0, atol=torch.finfo(torch.float16).eps * want.abs().max().item())


def test_sparse_inputs_and_outputs_are_refused_clearly():
    with pytest.raises(jvpreg.UnsupportedOpError, match="layout"):
        jvpreg.jvp(lambda x: x * 2, (X.to_sparse(),), (U.to_sparse(),))
    with pytest.raises(jvpreg.UnsupportedOpError, match="sparse"):
        jvpreg.jvp(lambda x: x.to_sparse(), (X,), (U,))


# ----------------------------------------------------------------------------- in-place ops on themselves, out=None

#: ``y.op_(y, ...)``: the target is also an operand. Reference: the explicit derivative (torch's forward AD gets
#: most of these wrong: it reads the operand's tangent after the write, e.g. y.mul_(y) gives y dy, not 2 y dy).
SELF_ALIASED = {
    "mul_": (lambda y: y.mul_(y), lambda x, u: 2 * x * u),
    "imul": (lambda y: y.__imul__(y), lambda x, u: 2 * x * u),
    "addcmul_": (lambda y: y.addcmul_(y, y, value=0.5), lambda x, u: (1 + x) * u),
    "pow_": (lambda y: y.pow_(y), lambda x, u: x ** x * (x.log() + 1) * u),
    "atan2_": (lambda y: y.atan2_(y), lambda x, u: 0 * u),
    "hypot_": (lambda y: y.hypot_(y), lambda x, u: math.sqrt(2) * u),
    "div_": (lambda y: y.div_(y), lambda x, u: 0 * u),
    "sub_": (lambda y: y.sub_(y * y), lambda x, u: (1 - 2 * x) * u),
    "add_alpha": (lambda y: y.add_(y, alpha=2), lambda x, u: 3 * u),
    "copy_flip": (lambda y: y.copy_(y.flip(-1)), lambda x, u: u.flip(-1)),
}
#: in-place ops with no clone rule: their exact per-op fallback runs eagerly only (the captured engine refuses them)
SELF_ALIASED_FALLBACK = {"pow_", "atan2_", "hypot_"}


@pytest.mark.filterwarnings("ignore::jvpreg.clone.eager.dispatch.JVPFallbackWarning")
@pytest.mark.parametrize("engine", ["eager", "captured"])
@pytest.mark.parametrize("name", list(SELF_ALIASED))
def test_inplace_op_on_itself_is_exact(name: str, engine: str) -> None:
    op, derivative = SELF_ALIASED[name]
    torch.manual_seed(0)
    x, u = torch.rand(3, 4, dtype=D) + 0.5, torch.randn(3, 4, dtype=D)
    refused = "has no clone rule and its exact per-op fallback" if engine != "eager" and name in SELF_ALIASED_FALLBACK \
        else ""
    with runs_engine(engine, calls=2, refused=refused):
        for _ in range(2):  # captured: the capture, then the replay
            out, t = jvpreg.jvp(lambda x: op(x.clone()), (x,), (u,), engine=engine)
    torch.testing.assert_close(out, op(x.clone()), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t, derivative(x, u), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("engine", ["eager", "captured"])
def test_an_explicit_out_none_is_the_out_of_place_call(engine: str) -> None:
    torch.manual_seed(0)
    x, u, w = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D), torch.randn(4, 2, dtype=D)

    def f(x):
        return torch.add(torch.maximum(torch.sin(x, out=None), x * 0.5, out=None), x, out=None).matmul(w)

    ref = torch.func.jvp(f, (x,), (u,))
    with runs_engine(engine, calls=2):
        for _ in range(2):  # captured: the capture, then the replay
            got = jvpreg.jvp(f, (x,), (u,), engine=engine)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_fallback_runs_under_warnings_as_errors() -> None:
    """torch warns (`torch.jit.script` is deprecated) while it loads its forward-AD decompositions on first use; a
    user's `-W error` must not turn that into a failed fallback. A fresh process: the load happens once."""
    import subprocess
    import sys

    code = ("import warnings, torch, jvpreg\n"
            "from jvpreg.clone.eager.dispatch import JVPFallbackWarning\n"
            "warnings.filterwarnings('ignore', category=JVPFallbackWarning)\n"
            "x, u = torch.rand(3, dtype=torch.float64) + 0.5, torch.randn(3, dtype=torch.float64)\n"
            "t = jvpreg.jvp(lambda x: x.pow(x), (x,), (u,))[1]\n"
            "ref = x ** x * (x.log() + 1) * u\n"
            "assert torch.allclose(t, ref), (t, ref)\n")
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)


@pytest.mark.parametrize("engine", ["eager", "captured"])
def test_mask_from_the_batch_in_a_data_dependent_shape_op(engine: str) -> None:
    """``x.masked_select(x > 0)``: the mask is the same in every block (a state clone), so it enters the per-block
    op unbatched; vmapping over it raised torch's 'differently shaped tensor' error."""
    torch.manual_seed(0)
    x, u = torch.randn(4, 6, dtype=D), torch.randn(4, 6, dtype=D)

    def f(x):
        return x.masked_select(x > 0).exp() + torch.masked_select(x.sin(), (x > 0.5) | (x < -1.0)).sum()

    ref = torch.func.jvp(f, (x,), (u,))
    with runs_engine(engine, calls=2):
        for _ in range(2):  # captured: the capture, then the replay
            got = jvpreg.jvp(f, (x,), (u,), engine=engine)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_abs_of_a_complex_intermediate_is_exact_also_at_zero() -> None:
    torch.manual_seed(0)
    x, u = torch.randn(4, 6, dtype=D), torch.randn(4, 6, dtype=D)
    x[0, :2] = 0.0  # a complex zero: torch's derivative there is 0 (sgn(0) = 0)

    def f(x):
        return torch.view_as_complex(x.view(4, 3, 2)).abs() + torch.fft.rfft(x, dim=1).abs().sum(1, keepdim=True)

    torch.testing.assert_close(jvpreg.jvp(f, (x,), (u,)), torch.func.jvp(f, (x,), (u,)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,module,slope", [
    ("celu", nn.CELU(0.7), lambda x: torch.where(x > 0, 1.0, torch.exp(x / 0.7))),
    ("hardsigmoid", nn.Hardsigmoid(), lambda x: ((x > -3) & (x < 3)).to(D) / 6),
])
def test_float64_tangents_are_exact_where_torchs_float64_derivative_is_not(name, module, slope) -> None:
    """Against the analytic derivative: torch's float64 CELU and hardsigmoid derivatives carry float32 constants
    (3.6e-8 and 1.7e-8 off here), so torch.func cannot be the reference at float64 precision."""
    assert (torch.func.jvp(module, (torch.full((3,), -0.5, dtype=D),), (torch.ones(3, dtype=D),))[1]
            - slope(torch.full((3,), -0.5, dtype=D))).abs().max() < 1e-6  # the analytic reference is the slope
    torch.manual_seed(0)
    x, u = torch.randn(2, 4, 5, dtype=D), torch.randn(2, 4, 5, dtype=D)
    for engine in ("eager", "captured"):
        for _ in range(2):
            _, t = jvpreg.jvp(module, (x,), (u,), engine=engine)
        torch.testing.assert_close(t, slope(x) * u, rtol=1e-14, atol=1e-15)
