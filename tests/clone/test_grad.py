"""The clone forward is differentiable: gradients of penalties on the JVP are exact.

For ``L = ||J u||^2`` and ``L = CE(f(x), labels) + lambda ||J u||^2`` the gradient w.r.t. every
parameter and the input from one backward through the clone forward must equal the float64
reference: ``torch.func.grad`` of a function that calls ``torch.func.jvp`` (forward-over-reverse)
on a twin of the network whose LayerNorm/BatchNorm layers are written with primitive ops (same
parameters). The twin is needed because torch's fused normalisation kernels are not exactly
differentiable to third order (the input gradient of ``||J u||^2`` through ``layer_norm`` by
torch.func or double backward, and through train-mode ``batch_norm`` by forward AD, is off by
~90% in torch 2.15; ``batch_norm`` refuses third-order derivatives), and torch.func cannot run a
train-mode BatchNorm with running statistics at all. Smooth rules keep ``sigma'(a)`` and the
normalisation statistics in the graph, so the second-order terms must match too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvpreg
from jvpreg.bench.memory import saved_bytes
from jvpreg.clone import fallback_mode

D = torch.float64
RTOL = 1e-9
LAMBDA = 0.3


class ManualLayerNorm(nn.LayerNorm):
    """LayerNorm from primitive ops. torch's fused layer_norm is not exactly differentiable to third order:
    the input gradient of ||J u||^2 by torch.func (jvp inside grad) or by double backward is wrong (93%
    relative error in torch 2.15), so the references below run the same math decomposed."""

    def forward(self, x):
        dims = tuple(range(-len(self.normalized_shape), 0))
        mu = x.mean(dims, keepdim=True)
        var = ((x - mu) ** 2).mean(dims, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class ManualBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Train-mode BatchNorm (batch statistics) from primitive ops; same parameter names as nn.BatchNorm*d.
    torch's batch_norm has no third-order derivative (double backward) and its forward-AD formula is not
    exactly differentiable either, hence the decomposition."""

    def forward(self, x):
        dims = (0,) + tuple(range(2, x.dim()))
        shape = (1, -1) + (1,) * (x.dim() - 2)
        mu = x.mean(dims, keepdim=True)
        var = ((x - mu) ** 2).mean(dims, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight.view(shape) + self.bias.view(shape)


def mlp(**_):
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Softplus(),
                         nn.Linear(8, 4))


def cnn(**_):
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, padding=1),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 4),
    )


class Attention(nn.Module):
    """LayerNorm + single-head softmax attention + mean-pooled head; tokens (B, L, E)."""

    def __init__(self, e=6, layer_norm=nn.LayerNorm):
        super().__init__()
        self.norm = layer_norm(e)
        self.q, self.k, self.v = nn.Linear(e, e), nn.Linear(e, e), nn.Linear(e, e)
        self.norm2 = layer_norm(e)
        self.head = nn.Linear(e, 4)

    def forward(self, x):
        h = self.norm(x)
        scores = self.q(h) @ self.k(h).transpose(-1, -2) / h.shape[-1] ** 0.5
        h = x + torch.softmax(scores, dim=-1) @ self.v(h)
        return self.head(self.norm2(h).mean(1))


class SDPAttention(Attention):
    """The same net through F.scaled_dot_product_attention."""

    def forward(self, x):
        h = self.norm(x)
        h = x + F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h), is_causal=True)
        return self.head(self.norm2(h).mean(1))


def attention(layer_norm=nn.LayerNorm):
    return Attention(layer_norm=layer_norm)


def sdp_attention(layer_norm=nn.LayerNorm):
    return SDPAttention(layer_norm=layer_norm)


def bn_net(bn2d=nn.BatchNorm2d, bn1d=nn.BatchNorm1d):
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), bn2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2), bn2d(4), nn.Tanh(),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 6), bn1d(6), nn.ReLU(), nn.Linear(6, 4),
    )


# "manual": keyword arguments that build the reference twin with decomposed normalisation layers
GRAD_SETTINGS = [
    {"id": "mlp-tanh-gelu-softplus", "module": mlp, "input_shape": (3, 6)},
    {"id": "cnn-maxpool", "module": cnn, "input_shape": (3, 2, 8, 8)},
    {"id": "layernorm-softmax-attention", "module": attention, "input_shape": (2, 5, 6),
     "manual": {"layer_norm": ManualLayerNorm}},
    {"id": "layernorm-sdpa-causal", "module": sdp_attention, "input_shape": (2, 5, 6),
     "manual": {"layer_norm": ManualLayerNorm}},
    {"id": "batchnorm-train", "module": bn_net, "input_shape": (4, 2, 8, 8), "train": True,
     "manual": {"bn2d": ManualBatchNorm, "bn1d": ManualBatchNorm}},
]


def penalty(y, t, labels, with_task_loss):
    loss = (t ** 2).sum()
    if with_task_loss:
        loss = F.cross_entropy(y, labels) + LAMBDA * loss
    return loss


def reference_grads(model, x, u, labels, with_task_loss):
    """Gradients w.r.t. (params..., x) of the penalty: torch.func.grad of a function calling torch.func.jvp."""
    names = [n for n, _ in model.named_parameters()]

    def loss_fn(params, x_):
        y, t = torch.func.jvp(lambda z: functional_call(model, params, (z,)), (x_,), (u,))
        return penalty(y, t, labels, with_task_loss)

    with sdpa_kernel(SDPBackend.MATH):
        g_params, g_x = torch.func.grad(loss_fn, argnums=(0, 1))(
            {n: p.detach() for n, p in model.named_parameters()}, x)
    return [g_params[n] for n in names] + [g_x]


@pytest.mark.parametrize("with_task_loss", [False, True], ids=["jvp-penalty", "task-loss-plus-penalty"])
@pytest.mark.parametrize("setting", GRAD_SETTINGS, ids=[s["id"] for s in GRAD_SETTINGS])
def test_gradient_of_jvp_penalty(setting, with_task_loss):
    torch.manual_seed(0)
    model = setting["module"]().to(D).train(setting.get("train", False))
    model_ref = setting["module"](**setting.get("manual", {})).to(D).train(setting.get("train", False))
    model_ref.load_state_dict(model.state_dict())
    x = torch.randn(setting["input_shape"], dtype=D)
    u = torch.randn_like(x)
    labels = torch.randint(0, 4, (x.shape[0],))

    xg = x.clone().requires_grad_(True)
    with fallback_mode("error"):
        y, t = jvpreg.jvp(model, (xg,), (u,))
    loss = penalty(y, t, labels, with_task_loss)
    grads = torch.autograd.grad(loss, [*model.parameters(), xg])

    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):  # the twin computes the same function and JVP
        y_twin, t_twin = torch.func.jvp(model_ref, (x,), (u,))
    torch.testing.assert_close(y.detach(), y_twin, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t.detach(), t_twin, rtol=1e-10, atol=1e-10 * t_twin.abs().max().item())

    want = reference_grads(model_ref, x, u, labels, with_task_loss)
    names = [n for n, _ in model.named_parameters()] + ["input"]
    for name, g, w in zip(names, grads, want):
        err = ((g - w).norm() / w.norm().clamp_min(1e-300)).item()
        assert err <= RTOL or (g - w).abs().max() <= 1e-13, f"grad of {name}: relative error {err:.2e}"


def test_gradient_with_several_tangents_batch():
    """k tangents in one pass: gradient of sum_j ||J u_j||^2 equals the sum of per-tangent gradients."""
    torch.manual_seed(0)
    model = mlp().to(D)
    x = torch.randn(3, 6, dtype=D)
    us = torch.randn(3, 3, 6, dtype=D)
    with fallback_mode("error"):
        _, ts = jvpreg.jvp(model, (x,), (us,), batched_tangents=True)
    grads = torch.autograd.grad((ts ** 2).sum(), list(model.parameters()))
    want = [torch.zeros_like(p) for p in model.parameters()]
    for j in range(3):
        _, t = jvpreg.jvp(model, (x,), (us[j],))
        for acc, g in zip(want, torch.autograd.grad((t ** 2).sum(), list(model.parameters()))):
            acc += g
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=1e-13)


def test_gradient_of_jvp_params_penalty():
    """Sensitivity penalty ||d f / d W [U]||^2 through jvp_params, w.r.t. every parameter."""
    torch.manual_seed(0)
    model = cnn().to(D)
    x = torch.randn(2, 2, 8, 8, dtype=D)
    U = torch.randn_like(model[3].weight)
    with fallback_mode("error"):
        _, t = jvpreg.jvp_params(model, (x,), {"3.weight": U})
    grads = torch.autograd.grad((t ** 2).sum(), list(model.parameters()))

    names = [n for n, _ in model.named_parameters()]

    def loss_fn(params):
        def f(w):
            return functional_call(model, {**params, "3.weight": w}, (x,))

        return (torch.func.jvp(f, (params["3.weight"],), (U,))[1] ** 2).sum()

    want = torch.func.grad(loss_fn)({n: p.detach() for n, p in model.named_parameters()})
    for n, g in zip(names, grads):
        err = ((g - want[n]).norm() / want[n].norm().clamp_min(1e-300)).item()
        assert err <= RTOL or (g - want[n]).abs().max() <= 1e-13, f"grad of {n}: relative error {err:.2e}"


# Rules whose tangent is torch's own backward kernel (``gelu_backward(d, a)``, ...): the gradient of a penalty
# then runs that kernel's double backward, checked here against finite differences (no autodiff formula in
# the reference).
KERNEL_TANGENT_LAYERS = {
    "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "gelu": nn.GELU, "gelu-tanh": lambda: nn.GELU(approximate="tanh"),
    "softplus": lambda: nn.Softplus(beta=2.0, threshold=3.0), "elu": lambda: nn.ELU(alpha=0.7),
    "hardswish": nn.Hardswish, "hardsigmoid": nn.Hardsigmoid, "softmax": lambda: nn.Softmax(dim=-1),
    "layer_norm": lambda: nn.LayerNorm(5),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "sigmoid" else n
                                  for n in KERNEL_TANGENT_LAYERS])
def test_backward_kernel_tangents_have_exact_gradients(name):
    """d/d(params, x) of ||J u||^2 for Linear -> layer -> Linear equals finite differences (float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), KERNEL_TANGENT_LAYERS[name](), nn.Linear(5, 3)).to(D)
    x = torch.randn(3, 4, dtype=D) * 2
    u = torch.randn_like(x)
    names = [n for n, _ in model.named_parameters()]

    def penalty_of(*tensors):
        params, x_ = dict(zip(names, tensors[:-1])), tensors[-1]
        with fallback_mode("error"):
            _, t = jvpreg.jvp(lambda z: functional_call(model, params, (z,)), (x_,), (u,))
        return (t ** 2).sum()

    inputs = [p.detach().clone().requires_grad_(True) for p in model.parameters()] + [x.requires_grad_(True)]
    assert torch.autograd.gradcheck(penalty_of, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_layer_norm_weight_direction_gradients_match_finite_differences():
    """jvp_params along LayerNorm's weight and bias: gradients of ||J U||^2 w.r.t. every parameter and x."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3)).to(D)
    x = torch.randn(3, 4, dtype=D)
    dirs = {"1.weight": torch.randn(5, dtype=D), "1.bias": torch.randn(5, dtype=D)}

    def penalty_of(*tensors):
        with jvpreg.clone.swapped_tensors(model, dict(zip(model.parameters(), tensors[:-1]))):
            _, t = jvpreg.jvp_params(model, (tensors[-1],), dirs)
        return (t ** 2).sum()

    inputs = [p.detach().clone().requires_grad_(True) for p in model.parameters()] + [x.requires_grad_(True)]
    assert torch.autograd.gradcheck(penalty_of, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("engine", ["eager", "captured"])
def test_train_batchnorm_keeps_a_primal_copy_not_the_2b_input(engine):
    """Conv -> train-mode BN -> ReLU -> Conv: BN keeps the primal block and d_j (together the size of the 2B
    input a plain forward keeps), relu one block: nothing else beyond the 2B forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 4, 3)).to(D).train()
    x, u = torch.randn(4, 3, 6, 6, dtype=D), torch.randn(4, 3, 6, 6, dtype=D)
    _, t = jvpreg.jvp(model, (x,), (u,), engine=engine)  # (captures)
    plain = saved_bytes(lambda: model(torch.cat([x, x])))
    clone = saved_bytes(lambda: jvpreg.jvp(model, (x,), (u,), engine=engine))
    block = 4 * 8 * 6 * 6 * 8
    # + relu(a), + per-channel vectors (statistics; the tangent's sums sum(d), sum(d xhat)), + the scale
    assert clone <= plain + block + 4 * 8 * 8 + 8, (clone, plain)


@pytest.mark.parametrize("engine", ["eager", "captured"])
@pytest.mark.parametrize("layer, extra_blocks", [
    (lambda: nn.ReLU(inplace=True), 1), (nn.ReLU, 1), (lambda: nn.LeakyReLU(0.1, inplace=True), 1),
    (nn.GELU, 0), (nn.Tanh, 2), (lambda: nn.LayerNorm(16), 0)])
def test_rules_keep_no_more_than_their_extra_blocks_for_backward(layer, extra_blocks, engine):
    """Saved-for-backward bytes of Linear -> layer -> Linear vs the plain 2B forward's. relu-like rules keep
    relu(a) (one block), not a view or copy of the 2B-row input; a smooth op keeps ``a`` and ``d_j`` (the size
    of the 2B input a plain forward keeps), and so does LayerNorm (its operator recomputes the unscaled tangent
    for the weight's gradient); tanh keeps tanh(a) and d_j where a plain forward keeps only the output: two.
    (Eager mode also keeps the non-finite fix's bool mask, an eighth of a float64 block.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), layer(), nn.Linear(16, 4)).to(D)
    x, u = torch.randn(5, 8, dtype=D), torch.randn(5, 8, dtype=D)
    _, t = jvpreg.jvp(model, (x,), (u,), engine=engine)  # (captures)
    torch.testing.assert_close(t, torch.func.jvp(model, (x,), (u,))[1])
    plain = saved_bytes(lambda: model(torch.cat([x, x])))
    clone = saved_bytes(lambda: jvpreg.jvp(model, (x,), (u,), engine=engine))
    block = 5 * 16 * 8
    assert clone <= plain + extra_blocks * block + block // 8 + 16 * 8 + 8, (clone, plain)


@pytest.mark.parametrize("engine", ["eager", "captured"])
@pytest.mark.parametrize("inplace", [False, True])
def test_large_relu_keeps_a_bool_block(engine, inplace):
    """From BOOL_MASK_NUMEL elements per block, relu keeps its pattern as bools (one byte per entry), so a relu
    network saves 2x the plain forward's bytes plus an eighth of a float64 block, not 2x plus a block."""
    from jvpreg.clone.rules.cpa import BOOL_MASK_NUMEL

    torch.manual_seed(0)
    width = BOOL_MASK_NUMEL // 4
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(inplace=inplace), nn.Linear(width, 4)).to(D)
    x, u = torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D)
    xg = x.clone().requires_grad_()
    _, t = jvpreg.jvp(model, (xg,), (u,), engine=engine)  # (captures)
    torch.testing.assert_close(t, torch.func.jvp(model, (x,), (u,))[1])
    plain = saved_bytes(lambda: model(torch.cat([xg, xg])))
    clone = saved_bytes(lambda: jvpreg.jvp(model, (xg,), (u,), engine=engine))
    bools = 4 * width  # one byte per entry of a block (a float64 block: 8)
    assert clone <= plain + 2 * bools + 8, (clone, plain)  # + the bool pattern (+ the eager nan mask), the scale
    t = jvpreg.jvp(model, (xg,), (u,), engine=engine)[1]
    (g,) = torch.autograd.grad(t.pow(2).sum(), xg)
    (want,) = torch.autograd.grad(torch.func.jvp(model, (xg,), (u,))[1].pow(2).sum(), xg)
    torch.testing.assert_close(g, want)


class SelfAttention(nn.Module):
    """``mha(x, x, x)`` without weights: the fused-kernel call a transformer block makes."""

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        self.mha = mha

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("engine", ["eager", "captured"])
def test_attention_keeps_the_value_blocks_not_the_packed_qkv_projection(engine):
    """MultiheadAttention's q, k, v are views of one packed projection: the attention rule's product with the
    value blocks must save a copy of those, not a view that keeps the whole (K, 3E) projection alive."""
    torch.manual_seed(0)
    model = SelfAttention(nn.MultiheadAttention(16, 2, batch_first=True).to(D))
    x, u = torch.randn(3, 5, 16, dtype=D), torch.randn(3, 5, 16, dtype=D)
    _, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
    with sdpa_kernel(SDPBackend.MATH):
        torch.testing.assert_close(t, torch.func.jvp(model, (x,), (u,))[1])
    sizes = []

    def pack(tensor):
        sizes.append(tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        jvpreg.jvp(model, (x,), (u,), engine=engine)
    packed = 2 * 3 * 16 * 3 * 5 * 8  # K blocks x (q, k, v) x E x B x T float64
    assert packed not in sizes, sorted(set(sizes))


def _operators_match_primitive_autograd(model, x, tangent, monkeypatch, engine="auto", batched=False):
    """Gradients of ||J u||^2 + sum f(x) (w.r.t. parameters and x) with jvpreg.clone.rules.kernels' operators equal those
    of the same rules with the operators switched off (autograd of aten kernels and primitive ops)."""
    import jvpreg.clone.rules.kernels as kernels

    def grads():
        m = copy.deepcopy(model)
        xg = x.clone().requires_grad_()
        for _ in range(2):  # the second call replays
            y, t = jvpreg.jvp(m, (xg,), (tangent,), engine=engine, batched_tangents=batched)
        return torch.autograd.grad(t.pow(2).sum() + y.sum(), [*m.parameters(), xg])

    applies, chosen = kernels.applies, []
    monkeypatch.setattr(kernels, "applies", lambda t: chosen.append(applies(t)) or chosen[-1])
    got = grads()
    assert any(chosen), f"no rule chose an operator: {chosen}"  # or the comparison below compares autograd with itself
    monkeypatch.setattr(kernels, "applies", lambda t: False)
    for g, w in zip(got, grads()):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("engine", ["eager", pytest.param("captured", marks=pytest.mark.slow)])
def test_group_norm_penalty_gradients_equal_autograd_of_primitive_ops(engine, monkeypatch):
    """GroupNorm's tangent under autograd (jvpreg.clone.rules.kernels.group_norm_tangent, its backward written out) vs
    the same rule through primitive ops with differentiable statistics (the operator switched off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.GroupNorm(3, 6), nn.Tanh(), nn.Conv2d(6, 4, 3),
                          nn.GroupNorm(2, 4, affine=False), nn.Flatten(), nn.Linear(4 * 3 * 3, 3)).to(D)
    x, u = torch.randn(3, 2, 5, 5, dtype=D), torch.randn(3, 2, 5, 5, dtype=D)
    _operators_match_primitive_autograd(model, x, u, monkeypatch, engine=engine)


@pytest.mark.parametrize("variant", ["contiguous", "channels_last", "no-affine", "two-tangents"])
def test_batchnorm_and_relu_operators_match_primitive_autograd(variant, monkeypatch):
    """Train-mode BatchNorm's and relu's operators (jvpreg.clone.rules.kernels, backward written out) vs the same rules
    with the operators switched off (autograd of aten kernels), for the layouts and shapes a training loop meets."""
    from jvpreg.clone.rules.cpa import BOOL_MASK_NUMEL

    torch.manual_seed(0)
    width = -(-BOOL_MASK_NUMEL // (4 * 5 * 5))  # relu blocks large enough for the bool-pattern operator
    model = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width, affine=variant != "no-affine"),
                          nn.ReLU(inplace=True), nn.Conv2d(width, 4, 3), nn.Flatten(), nn.Linear(4 * 3 * 3, 2)).to(D)
    x = torch.randn(4, 3, 5, 5, dtype=D)
    if variant == "channels_last":
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    k = 2 if variant == "two-tangents" else 1
    us = torch.randn(k, *x.shape, dtype=D)
    _operators_match_primitive_autograd(model, x, us if k > 1 else us[0], monkeypatch, batched=k > 1)


@pytest.mark.parametrize("engine", ["eager", pytest.param("captured", marks=pytest.mark.slow)])
def test_large_attention_keeps_no_score_sized_tensor(engine, monkeypatch):
    """From ATTENTION_RECOMPUTE_NUMEL entries of P, the attention rule keeps its inputs only (as fused attention
    does) and recomputes P, dS and dP in the backward; the composite keeps all three. The gradients agree."""
    from jvpreg.clone.rules import kernels

    torch.manual_seed(0)
    heads, length = 2, 128
    mha = nn.MultiheadAttention(16, heads, batch_first=True).to(D)

    x, u = torch.randn(2, length, 16, dtype=D), torch.randn(2, length, 16, dtype=D)
    scores = 2 * heads * length * length * 8  # one block of P, float64
    monkeypatch.setattr(kernels, "ATTENTION_RECOMPUTE_NUMEL", scores // 8)

    def run():
        model = SelfAttention(mha)
        xg = x.clone().requires_grad_()
        storages = {}  # the distinct storages kept for backward, by address

        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        jvpreg.jvp(model, (xg,), (u,), engine=engine)  # (captures)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            _, t = jvpreg.jvp(model, (xg,), (u,), engine=engine)
        sizes = sorted(storages.values())
        return sizes, torch.autograd.grad(t.pow(2).sum(), [xg, *model.parameters()])

    sizes, grads = run()
    assert sizes[-1] < scores, sizes
    monkeypatch.setattr(kernels, "ATTENTION_RECOMPUTE_NUMEL", 1 << 60)
    composite, want = run()
    assert composite.count(scores) >= 3, composite  # P, dS, dP
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # two compilations
def test_compiled_program_runs_the_recomputing_attention_operator_from_its_threshold(monkeypatch):
    """In a program for ``engine="compiled"`` attention runs as the recomputing operator from
    COMPILED_ATTENTION_RECOMPUTE_NUMEL entries of P (the composite below): the same JVP and penalty gradients."""
    from jvpreg.clone.program import capture
    from jvpreg.clone.rules import kernels

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).to(D)
    x, u = torch.randn(2, 6, 8, dtype=D), torch.randn(2, 6, 8, dtype=D)

    def run(threshold):
        monkeypatch.setattr(kernels, "COMPILED_ATTENTION_RECOMPUTE_NUMEL", threshold)
        model = SelfAttention(mha)
        xg = x.clone().requires_grad_()
        _, t = jvpreg.jvp(model, (xg,), (u,), engine="compiled")
        (program,) = [p for p in capture.programs(model).values() if p.gm is not None]
        ops = {str(n.target) for n in program.gm.graph.nodes if n.op == "call_function"}
        grads = torch.autograd.grad(t.pow(2).sum(), [xg, *mha.parameters()])
        return "jvpreg.attention_blocks.default" in ops, [t, *grads]

    recomputed, got = run(0)
    composite, want = run(float("inf"))
    assert recomputed and not composite
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


_BROADCASTS = {  # q, k, v, blocks, dq, dk, mask shapes of the recomputing attention operator (batch 3, heads 2)
    "query-and-mask-broadcast": [(1, 2, 5, 4), (3, 2, 7, 4), (3, 2, 7, 4), (2, 3, 2, 7, 4), (1, 1, 2, 5, 4),
                                 (1, 3, 2, 7, 4), (1, 1, 5, 7)],
    "only-value-and-mask-batched": [(1, 2, 5, 4), (1, 2, 7, 4), (3, 2, 7, 4), (2, 3, 2, 7, 4), (1, 1, 2, 5, 4),
                                    (1, 1, 2, 7, 4), (3, 1, 5, 7)],
}


def _attention_operator_grads(shapes, chunk_numel, monkeypatch):
    """Output, gradients and a second-order gradient of the recomputing attention operator for inputs of
    ``shapes`` (some broadcast along the batch dim)."""
    from jvpreg.clone.rules import kernels

    monkeypatch.setattr(kernels, "ATTENTION_BACKWARD_CHUNK_NUMEL", chunk_numel)
    g = torch.Generator().manual_seed(0)
    ins = [torch.randn(*s, dtype=D, generator=g).requires_grad_() for s in shapes]
    q, k, v, blocks, dq, dk, mask = ins
    out = kernels.attention_blocks(q, k, blocks[0] + 0 * v, blocks, dq, dk, mask, 0.5, False, 2)
    grads = torch.autograd.grad(out.pow(2).sum(), ins, create_graph=True)
    second = torch.autograd.grad(sum(x.pow(2).sum() for x in grads), ins)
    return [out, *grads, *second]


@pytest.mark.parametrize("shapes", _BROADCASTS.values(), ids=_BROADCASTS.keys())
def test_attention_backward_by_chunks_equals_the_whole_batch(shapes, monkeypatch):
    """The recomputing attention operator's backward one batch row at a time: sliced inputs concatenate their
    chunks' gradients, broadcast ones (batch 1 against the output's 3) sum them; first and second order match the
    backward over the whole batch."""
    whole = _attention_operator_grads(shapes, float("inf"), monkeypatch)
    chunked = _attention_operator_grads(shapes, 1, monkeypatch)
    for a, b in zip(chunked, whole):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k_blocks", [2, 3], ids=["one-tangent", "two-tangents"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("present", ["blocks,dq,dk", "blocks", "dq,dk", "dq", "dk", "blocks,dk"])
def test_attention_written_out_backward_equals_autograd_of_the_recomputed_attention(present, causal, mask, k_blocks):
    """The operator's first-order backward (written out, :func:`jvpreg.clone.rules.kernels._attention_grads`) against
    autograd of the attention it recomputes, in float64, for every input the rule may pass or leave out: value
    blocks or a constant value, query and key tangents, no mask, a boolean one (one row fully masked: ``P`` 0 there)
    or an additive one that requires grad (a learned position bias), causal or not, one or two tangents, a query
    and a mask of batch 1 against keys of batch 3."""
    from jvpreg.clone.rules import kernels

    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, dtype=D, generator=g).requires_grad_()  # noqa: E731
    kt = k_blocks - 1
    q, k, v = rand(1, 2, 5, 4), rand(3, 2, 7, 4), rand(3, 2, 7, 3)
    blocks = rand(k_blocks, 3, 2, 7, 3) if "blocks" in present else None
    dq = rand(kt, 1, 2, 5, 4) if "dq" in present.split(",") else None
    dk = rand(kt, 3, 2, 7, 4) if "dk" in present.split(",") else None
    m = None
    if mask == "bool":
        m = torch.rand(1, 1, 5, 7, generator=g) > 0.3
        m[..., 0, :] = m[..., 1, :] = True
        m[..., 2, :] = False  # a row whose keys are all masked
    elif mask == "float":
        m = rand(1, 2, 5, 7)
    ins = [q, k, v, blocks, dq, dk, m]
    wrt = [t for t in ins if t is not None and t.requires_grad]
    grad = torch.randn(k_blocks, 3, 2, 5, 3, dtype=D, generator=g)
    got = torch.autograd.grad(kernels.attention_blocks(*ins, 0.5, causal, k_blocks), wrt, grad, allow_unused=True)
    want = torch.autograd.grad(kernels._attention(*ins, 0.5, causal, k_blocks), wrt, grad, allow_unused=True)
    for a, b in zip(got, want):  # (the primal value is unused where value blocks come without q, k tangents)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shapes", _BROADCASTS.values(), ids=_BROADCASTS.keys())
def test_attention_written_out_backward_where_the_value_and_mask_set_the_batch(shapes):
    """The written-out backward where a batched value or mask (not the query and key) gives the output its batch:
    every input's gradient summed back to its own shape, equal to autograd of the recomputed attention."""
    from jvpreg.clone.rules import kernels

    g = torch.Generator().manual_seed(1)
    ins = [torch.randn(*s, dtype=D, generator=g).requires_grad_() for s in shapes]
    out = kernels._attention(*ins, 0.5, False, 2)
    grad = torch.randn(out.shape, dtype=D, generator=g)
    got = torch.autograd.grad(kernels.attention_blocks(*ins, 0.5, False, 2), ins, grad)
    for a, b in zip(got, torch.autograd.grad(out, ins, grad)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # the profiler's memory timeline: 10 s
def test_attention_backward_by_chunks_lowers_the_live_peak(monkeypatch):
    """The recomputed backward keeps P, dS, dP and their gradients for one chunk of the batch at a time: a
    regularized step's live-tensor peak falls well below the whole-batch backward's."""
    from jvpreg.bench import memory
    from jvpreg.clone.rules import kernels

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x, u = torch.randn(4, 256, 16), torch.randn(4, 256, 16)  # P (256 x 256 per head) well above the activations

    def live_peak(chunk_numel):
        monkeypatch.setattr(kernels, "ATTENTION_BACKWARD_CHUNK_NUMEL", chunk_numel)
        model = SelfAttention(mha)

        def step():
            _, t = jvpreg.jvp(model, (x,), (u,))
            t.pow(2).sum().backward()

        step()
        return memory.peak_live_bytes(step)

    whole = live_peak(float("inf"))
    if whole is None:
        pytest.skip("torch.profiler's memory timeline is not available")
    scores = 2 * 4 * 2 * 64 * 64 * 4  # every block's P, float32
    assert whole > 2 * scores  # P, dS, dP ... of the whole batch
    assert live_peak(2 * 64 * 64) < 0.5 * whole  # one batch row (2 heads) at a time


class _Normed(nn.Module):
    """Norms whose weights ``w(a)`` carry second-order terms into a penalty's gradient."""

    def __init__(self, ord):
        super().__init__()
        self.lin, self.ord = nn.Linear(4, 6).double(), ord

    def forward(self, x):
        h = self.lin(x)
        return torch.linalg.vector_norm(h, self.ord, dim=-1) + F.normalize(h, dim=-1).norm(dim=-1, p=3) * h[:, 0]


@pytest.mark.parametrize("engine", ["eager", pytest.param("captured", marks=pytest.mark.slow)])
@pytest.mark.parametrize("ord", [2, 3, 1.5, float("inf")])
def test_norm_penalty_gradients_keep_the_weights_dependence_on_the_input(ord, engine):
    """d/dW of ||J u||^2 through vector norms (and Tensor.norm, F.normalize), against torch.func in float64:
    a rule whose weights were detached from the primal got -0.666 for -0.708 (finite differences)."""
    torch.manual_seed(0)
    model = _Normed(ord)
    x, u = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    with fallback_mode("error"):  # Tensor.norm and every order >= 1 have rules: capturable
        _, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
    _, t0 = torch.func.jvp(model, (x,), (u,))
    params = list(model.parameters())
    got = torch.autograd.grad(t.pow(2).sum(), params)
    want = torch.autograd.grad(t0.pow(2).sum(), params)
    torch.testing.assert_close(t, t0, rtol=1e-12, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_as_strided_scatter_gradients_match_finite_differences():
    """as_strided_scatter's own input gradient (torch 2.15) lands on the window, not its complement; the rule's
    gradients of a penalty on the JVP match central differences."""
    torch.manual_seed(0)
    inp, src = torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    u = torch.randn(3, 4, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.float64)

    def penalty(x):
        y, t = jvpreg.jvp(lambda z: torch.as_strided_scatter(z, src * z[0, 0], (2, 2), (1, 2), 1), (x,), (u,))
        return (w * t).sum() + (w * y).sum()

    x = inp.clone().requires_grad_()
    (g,) = torch.autograd.grad(penalty(x), x)
    v = torch.randn(3, 4, dtype=torch.float64)
    h = 1e-4
    fd = (penalty(inp + h * v) - penalty(inp - h * v)) / (2 * h)
    torch.testing.assert_close((g * v).sum(), fd.detach(), rtol=1e-7, atol=1e-9)


def test_in_place_abs_has_a_gradient():
    """abs_ overwrites its input: its rule must not keep the input for backward (it kept it through sign)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    x, u = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    _, t = jvpreg.jvp(lambda z: lin(z).abs_(), (x,), (u,))
    _, t0 = torch.func.jvp(lambda z: lin(z).abs(), (x,), (u,))
    got = torch.autograd.grad(t.pow(2).sum(), lin.weight)[0]
    want = torch.autograd.grad(t0.pow(2).sum(), lin.weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,channels", [((), 1), ((3, 4, 5), 4), ((3, 4), 1)])
def test_prelu_weight_direction_has_a_rule(shape, channels):
    """A PReLU weight direction with a plain input runs the rule (no per-op fallback, so it is capturable), 0-d
    inputs included, and matches torch.func."""
    torch.manual_seed(0)
    m = nn.PReLU(channels).double()
    x, U = torch.randn(shape, dtype=torch.float64), torch.randn(channels, dtype=torch.float64)
    with fallback_mode("error"):
        _, t = jvpreg.jvp_params(m, (x,), {"weight": U})
    _, t0 = torch.func.jvp(lambda w: functional_call(m, {"weight": w}, (x,)), (m.weight.detach(),), (U,))
    torch.testing.assert_close(t, t0, rtol=1e-12, atol=1e-12)


def test_check_finds_a_rule_whose_gradient_is_wrong():
    """``sweep.check`` (the README's advice for a rule of your own): "" for the engine's rule; a gradient
    difference for a rule exact in value whose slope is detached from the primal."""
    from conftest import sinh_rule_with_a_detached_slope
    from jvpreg.clone import register_handler
    import op_sweep as sweep
    from jvpreg.clone.core.registry import HANDLERS

    x = torch.randn(3, 4, dtype=torch.float64)
    assert sweep.check(torch.sinh, x) == ""
    old = HANDLERS.pop(torch.sinh, None)
    try:
        register_handler(torch.sinh)(sinh_rule_with_a_detached_slope)
        assert sweep.check(torch.sinh, x).startswith("mismatch: gradient")
    finally:
        HANDLERS.pop(torch.sinh, None)
        if old is not None:
            HANDLERS[torch.sinh] = old
    assert sweep.check(torch.sinh, x) == ""


def test_as_strided_scatter_on_a_view_matches_finite_differences():
    """A plain input that is a view (storage offset 3): the window is placed in the input's own storage, as torch
    does (torch.func's tangent places it elsewhere in torch 2.15; the fallback used before gave gradients of
    1e6). Tangent and the gradient of a penalty on it w.r.t. the scattered source, against central differences."""
    torch.manual_seed(0)
    inp = torch.randn(20, dtype=torch.float64)[3:15].view(3, 4)
    src, u = torch.randn(2, 2, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.float64)

    def f(s):
        return torch.as_strided_scatter(inp, s.sin(), (2, 2), (1, 2), 5)

    def penalty(s):
        return (w * jvpreg.jvp(f, (s,), (u,))[1]).sum()

    h = 1e-5
    _, t = jvpreg.jvp(f, (src,), (u,))
    torch.testing.assert_close(t, (f(src + h * u) - f(src - h * u)) / (2 * h), rtol=1e-8, atol=1e-9)
    s = src.clone().requires_grad_()
    (g,) = torch.autograd.grad(penalty(s), s)
    v = torch.randn(2, 2, dtype=torch.float64)
    fd = (penalty(src + h * v) - penalty(src - h * v)) / (2 * h)
    torch.testing.assert_close((g * v).sum(), fd.detach(), rtol=1e-7, atol=1e-9)
