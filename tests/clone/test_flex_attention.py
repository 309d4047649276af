"""FlexAttention in clone mode (``jvpreg/clone/rules/flex_attention.py``), where ``torch.func.jvp`` fails.

References, in float64: ``torch.func.jvp`` of the same attention written as a dense softmax (checked equal to
``flex_attention``'s output first), and central finite differences of ``flex_attention`` itself (on the CPU flex has
no backward, so no reverse-mode Jacobian). The primal output is bit-identical to a plain call.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jvpreg
from conftest import count_captures, runs_engine

flex = pytest.importorskip("torch.nn.attention.flex_attention")

D = torch.float64
B, H, L, E = 2, 2, 8, 4
GEN = torch.Generator().manual_seed(0)
Q, K, V = (torch.randn(B, H, L, E, dtype=D, generator=GEN) for _ in range(3))
UQ, UK, UV = (torch.randn(B, H, L, E, dtype=D, generator=GEN) for _ in range(3))
BIAS = torch.randn(H, L, L, dtype=D, generator=GEN)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


CAUSAL = flex.create_block_mask(causal, B, H, L, L, device="cpu")
CASES = {
    "plain": lambda q, k, v: flex.flex_attention(q, k, v),
    "alibi": lambda q, k, v: flex.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + 0.1 * (h + 1) * (i - j)),
    "bias_table": lambda q, k, v: flex.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + BIAS[h, i, j]),
    "softcap": lambda q, k, v: flex.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: 5 * torch.tanh(s / 5)),
    "causal_block_mask": lambda q, k, v: flex.flex_attention(q, k, v, block_mask=CAUSAL),
    "gqa": lambda q, k, v: flex.flex_attention(q, k[:, :1], v[:, :1], enable_gqa=True),
    "lse": lambda q, k, v: torch.cat([t.reshape(-1) for t in flex.flex_attention(
        q, k, v, block_mask=CAUSAL, return_aux=flex.AuxRequest(lse=True))[:1]] + [flex.flex_attention(
            q, k, v, block_mask=CAUSAL, return_aux=flex.AuxRequest(lse=True))[1].lse.reshape(-1)]),
}


#: Why the captured engine runs each case eagerly (it says so with a JVPCaptureWarning). The rule computes the primal
#: block with flex's operator, a custom autograd.Function on plain tensors, which a capture refuses under grad mode
#: (its backward would not be replayed); a function that closes over a BlockMask cannot be taken apart.
REFUSED = {case: "it holds a BlockMask" if "block_mask" in case or case == "lse"
           else "the custom autograd.Function FlexAttentionAutogradOp runs on plain tensors" for case in CASES}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def dense_attention(q, k, v, score_mod=None, mask_mod=None, gqa=False, lse=False):
    """The attention of flex_attention as ordinary ops: softmax(where(mask, score_mod(q k^T / sqrt(E)), -inf)) v."""
    if gqa:
        k, v = k.repeat_interleave(q.size(1) // k.size(1), 1), v.repeat_interleave(q.size(1) // v.size(1), 1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    b, h, i, j = (torch.arange(n).view([n if d == a else 1 for d in range(4)]) for a, n in enumerate(s.shape))
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j), -math.inf)
    out = s.softmax(-1) @ v
    return torch.cat([out.reshape(-1), s.logsumexp(-1).reshape(-1)]) if lse else out


ALIBI = lambda s, b, h, i, j: s + 0.1 * (h + 1) * (i - j)  # noqa: E731
TABLE = lambda s, b, h, i, j: s + BIAS[h, i, j]  # noqa: E731
SOFTCAP = lambda s, b, h, i, j: 5 * torch.tanh(s / 5)  # noqa: E731
DENSE = {
    "plain": lambda q, k, v: dense_attention(q, k, v),
    "alibi": lambda q, k, v: dense_attention(q, k, v, ALIBI),
    "bias_table": lambda q, k, v: dense_attention(q, k, v, TABLE),
    "softcap": lambda q, k, v: dense_attention(q, k, v, SOFTCAP),
    "causal_block_mask": lambda q, k, v: dense_attention(q, k, v, mask_mod=causal),
    "gqa": lambda q, k, v: dense_attention(q, k[:, :1], v[:, :1], gqa=True),
    "lse": lambda q, k, v: dense_attention(q, k, v, mask_mod=causal, lse=True),
}


@pytest.mark.parametrize("engine", ["eager", "captured"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_jvp_equals_that_of_the_dense_attention(case, engine):
    f = CASES[case]
    y0 = f(Q, K, V)
    torch.testing.assert_close(DENSE[case](Q, K, V), y0, rtol=1e-13, atol=1e-14)  # the same function
    _, want = torch.func.jvp(DENSE[case], (Q, K, V), (UQ, UK, UV))
    with runs_engine(engine, calls=2, refused="" if engine == "eager" else REFUSED[case]):
        for _ in range(2):  # the capture, then a replay
            y, t = jvpreg.jvp(f, (Q, K, V), (UQ, UK, UV), engine=engine)
    assert torch.equal(y, y0)
    torch.testing.assert_close(t, want, rtol=1e-12, atol=1e-13)
    eps = 1e-6
    fd = (f(Q + eps * UQ, K + eps * UK, V + eps * UV) - f(Q - eps * UQ, K - eps * UK, V - eps * UV)) / (2 * eps)
    torch.testing.assert_close(t, fd, rtol=1e-7, atol=1e-8)
    assert getattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False) is False  # put back after the forward


def test_torch_func_fails_where_jvpreg_does_not():
    """torch.func.jvp refuses flex_attention (torch 2.14: dynamo's ``Unsupported``, a RuntimeError naming the higher
    order op); jvpreg's JVP of the same call is the dense attention's."""
    with pytest.raises(RuntimeError, match="flex_attention"):
        torch.func.jvp(CASES["plain"], (Q, K, V), (UQ, UK, UV))
    _, want = torch.func.jvp(DENSE["plain"], (Q, K, V), (UQ, UK, UV))
    torch.testing.assert_close(jvpreg.jvp(CASES["plain"], (Q, K, V), (UQ, UK, UV))[1], want, rtol=1e-12, atol=1e-13)


class FlexBlock(nn.Module):
    """Self-attention through flex_attention (``dense=True``: the same attention as a dense softmax)."""

    def __init__(self, dense=False):
        super().__init__()
        self.qkv, self.out, self.dense = nn.Linear(E * H, 3 * E * H), nn.Linear(E * H, 3), dense

    def forward(self, x):  # (N, L, E*H)
        q, k, v = self.qkv(x).unflatten(-1, (3, H, E)).permute(2, 0, 3, 1, 4)
        if self.dense:
            s = q @ k.transpose(-2, -1) / math.sqrt(E)
            i, j = torch.arange(L, device=x.device).view(L, 1), torch.arange(L, device=x.device).view(1, L)
            s = (s + 0.1 * (i - j)).masked_fill(i < j, -math.inf)
            a = s.softmax(-1) @ v
        else:
            mask = flex.create_block_mask(causal, B, H, L, L, device=x.device)
            a = flex.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + 0.1 * (i - j), block_mask=mask)
        return self.out(a.transpose(1, 2).flatten(2)).mean(1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention has no backward on the CPU (torch's "
                    "NotImplementedError, in a plain training step too)")
@pytest.mark.parametrize("engine", ["eager", "auto"])
def test_penalty_gradients_equal_those_of_the_dense_attention(engine):
    torch.manual_seed(0)
    model = FlexBlock().to(D).cuda()
    dense = FlexBlock(dense=True).to(D).cuda()
    dense.load_state_dict(model.state_dict())
    x, u = torch.randn(B, L, E * H, dtype=D, device="cuda"), torch.randn(B, L, E * H, dtype=D, device="cuda")

    _, ju = torch.func.jvp(dense, (x,), (u,))
    ju.square().sum().backward()
    want = {n: p.grad for n, p in dense.named_parameters()}
    for _ in range(3):
        model.zero_grad()
        _, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
        t.square().sum().backward()
    for n, p in model.named_parameters():  # (the output bias cancels from the tangent: a zero gradient, or None)
        got = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(got, torch.zeros_like(p) if want[n] is None else want[n], rtol=1e-10, atol=1e-12,
                                   msg=n)


def test_a_score_mod_that_does_not_broadcast_is_refused_by_name():
    """``table[i][j]`` is a scalar per element under flex's vmap; on broadcast indices it indexes the wrong dim."""
    table = torch.randn(L, L, dtype=D)

    def chained(q, k, v):
        return flex.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + table[i][j])

    chained(Q, K, V)  # flex itself runs it
    with pytest.raises(NotImplementedError, match=r"flex_attention's score_mod(.|\n)*elementwise"):
        jvpreg.jvp(chained, (Q, K, V), (UQ, UK, UV), engine="eager")


@pytest.mark.parametrize("engine", ["eager", "captured"])
def test_a_score_mod_that_means_another_thing_on_broadcast_indices_is_refused(engine):
    """``3 s - s.mean()`` is ``2 s`` per element under vmap (flex) and ``3 s`` less a constant on broadcast indices:
    the same shape, another attention. The primal check refuses it instead of linearising it."""

    def centred(q, k, v):
        return flex.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: 3 * s - s.mean())

    with count_captures() as n, pytest.raises(NotImplementedError, match="another attention than flex computes"):
        jvpreg.jvp(centred, (Q, K, V), (UQ, UK, UV), engine=engine)
    # captured: the capture raises the error, or is refused (REFUSED) and the eager run raises it; no program runs
    assert n.recorded == n.replays == 0 and n.raised + n.refused + len(n.uncaptured) == (engine != "eager"), n


@pytest.mark.slow
def test_captured_flex_attention_under_no_grad_runs_eagerly_with_its_reason():
    """Under no_grad FlexAttention leaves a vmap-wrapped constant in the traced program: the capture refuses it with
    a reason (before: a RuntimeError from inside the capture's passes), and the eager run is exact."""
    import warnings

    import jvpreg
    from jvpreg.clone.program import capture
    from torch.nn.attention import flex_attention as flex

    q, k, v = (torch.randn(2, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    f = lambda q, k, v: flex.flex_attention(q, k, v)  # noqa: E731
    capture._WARNED.clear()
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        want = jvpreg.jvp(f, (q, k, v), (q, k, v), engine="eager")[1]
        got = jvpreg.jvp(f, (q, k, v), (q, k, v), engine="captured")[1]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert any("torch.func transform inside the forward wrapped" in str(w.message) for w in seen)
