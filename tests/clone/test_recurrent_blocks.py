"""The Elman RNN written on the blocks (relu/tanh) against torch.func in float64: layouts, layers,
directions, unbatched input, an initial state from the batch, and parameter gradients."""
import itertools

import pytest
import torch
import torch.nn as nn

import jvpreg

D = torch.float64
GRID = list(itertools.product(["relu", "tanh"], [True, False], [True, False], [1, 2]))


@pytest.mark.parametrize("nl,batch_first,bidir,layers", GRID,
                         ids=[f"{n}-bf{int(b)}-bi{int(d)}-L{l}" for n, b, d, l in GRID])
def test_elman_rnn_matches_torch_func(nl, batch_first, bidir, layers):
    torch.manual_seed(0)
    rnn = nn.RNN(4, 5, num_layers=layers, nonlinearity=nl, batch_first=batch_first, bidirectional=bidir).to(D)
    x, u = torch.randn(3, 6, 4, dtype=D), torch.randn(3, 6, 4, dtype=D)
    f = lambda z: (rnn(z)[0], rnn(z)[1])
    for got, ref in zip(jvpreg.jvp(f, (x,), (u,))[1], torch.func.jvp(f, (x,), (u,))[1]):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    xu, uu = torch.randn(6, 4, dtype=D), torch.randn(6, 4, dtype=D)  # unbatched
    g = lambda z: rnn(z)[0]
    torch.testing.assert_close(jvpreg.jvp(g, (xu,), (uu,))[1], torch.func.jvp(g, (xu,), (uu,))[1],
                               rtol=1e-10, atol=1e-12)
    b = x.shape[0] if batch_first else x.shape[1]
    h0 = torch.randn((2 if bidir else 1) * layers, b, 5, dtype=D)  # initial state from the batch
    uh = torch.randn_like(h0)
    h = lambda z, s: rnn(z, s)[0]
    torch.testing.assert_close(jvpreg.jvp(h, (x, h0), (u, uh))[1], torch.func.jvp(h, (x, h0), (u, uh))[1],
                               rtol=1e-10, atol=1e-12)


def test_elman_rnn_parameter_gradients_match_torch_func():
    torch.manual_seed(0)
    rnn = nn.RNN(4, 5, nonlinearity="relu", batch_first=True).to(D)
    x, u = torch.randn(3, 6, 4, dtype=D), torch.randn(3, 6, 4, dtype=D)
    y, t = jvpreg.jvp(lambda z: rnn(z)[0], (x,), (u,))
    got = torch.autograd.grad(t.pow(2).sum() + y.sum(), list(rnn.parameters()))
    names = [n for n, _ in rnn.named_parameters()]

    def loss(*ps):
        f = lambda z: torch.func.functional_call(rnn, dict(zip(names, ps)), (z,))[0]
        yy, tt = torch.func.jvp(f, (x,), (u,))
        return tt.pow(2).sum() + yy.sum()

    ref = torch.func.grad(loss, argnums=tuple(range(len(names))))(*[p.detach() for p in rnn.parameters()])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_elman_rnn_dropout_between_layers_uses_one_mask_for_every_block():
    """Train mode, dropout between layers: with tangents (u, 2u) in one pass, the second JVP is exactly
    twice the first (one mask shared by the blocks)."""
    torch.manual_seed(0)
    rnn = nn.RNN(4, 5, num_layers=2, nonlinearity="relu", dropout=0.5, batch_first=True).to(D).train()
    x, u = torch.randn(3, 6, 4, dtype=D), torch.randn(3, 6, 4, dtype=D)
    torch.manual_seed(1)
    y, t = jvpreg.jvp(lambda z: rnn(z)[0], (x,), (torch.stack([u, 2 * u]),), batched_tangents=True)
    torch.testing.assert_close(t[1], 2 * t[0], rtol=1e-12, atol=1e-12)
    assert t[0].abs().sum() > 0
    # with the mask fixed to all-ones (p -> 0 in eval), the same code path matches torch.func exactly
    rnn.eval()
    f = lambda z: rnn(z)[0]
    torch.testing.assert_close(jvpreg.jvp(f, (x,), (u,))[1], torch.func.jvp(f, (x,), (u,))[1], rtol=1e-10, atol=1e-12)


class _Seq(nn.Module):
    """A recurrent module returning its output and final states (the tangent recurrence and its last state)."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, h0=None):
        out, state = self.rnn(x, h0)
        return (out, *state) if isinstance(state, tuple) else (out, state)


RECURRENT = {
    "tanh-2layers-bidirectional": lambda: nn.RNN(4, 5, num_layers=2, bidirectional=True),
    "lstm-proj-bidirectional": lambda: nn.LSTM(4, 5, proj_size=3, bidirectional=True),
    "lstm-2layers-batch_first": lambda: nn.LSTM(4, 5, num_layers=2, batch_first=True),
    "gru-2layers-bidirectional": lambda: nn.GRU(4, 5, num_layers=2, bidirectional=True),
}


@pytest.mark.parametrize("engine", ["eager", pytest.param("captured", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(RECURRENT))
def test_several_tangents_and_an_initial_state_tangent_match_torch_func(name, engine):
    """k = 3 directions in one pass: the tangent recurrence runs on (k B)-row matrices (block-major rows)."""
    torch.manual_seed(0)
    net = _Seq(RECURRENT[name]().to(D))
    x = torch.randn(6, 2, 4, dtype=D)
    us = torch.randn(3, *x.shape, dtype=D)
    _, got = jvpreg.jvp(net, (x,), (us,), batched_tangents=True, engine=engine)
    for j in range(3):
        _, ref = torch.func.jvp(net, (x,), (us[j],))
        for g, r in zip(got, ref):
            torch.testing.assert_close(g[j], r, rtol=1e-10, atol=1e-12)
