"""Packed sequences (torch.nn.utils.rnn) through nn.RNN / nn.LSTM / nn.GRU in clone mode.

torch.func.jvp cannot run them (``_pack_padded_sequence`` has no forward-mode formula), so the reference is the
reverse-mode Jacobian in float64 applied to the tangent."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import jvpreg
from jvpreg.clone import JVPCaptureWarning
from jvpreg.clone.program import capture

D = torch.float64


@pytest.fixture(autouse=True)
def capture_on_first_call(monkeypatch):
    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", 0)


def reverse_jvp(f, x, u):
    """``J u`` from the reverse-mode Jacobian of ``f`` at ``x``."""
    y = f(x)
    jac = torch.autograd.functional.jacobian(f, x)
    return (jac.reshape(y.numel(), x.numel()) @ u.reshape(-1)).reshape(y.shape)


class PackedRNN(nn.Module):
    """Pack a padded batch, run the recurrent module, unpad, and return every output and the final state."""

    def __init__(self, cell, lengths, batch_first, enforce_sorted=True, **kw):
        super().__init__()
        self.rnn = cell(3, 4, batch_first=batch_first, **kw)
        self.lengths, self.batch_first, self.enforce_sorted = lengths, batch_first, enforce_sorted

    def forward(self, x, h0=None):
        packed = pack_padded_sequence(x, self.lengths, batch_first=self.batch_first,
                                      enforce_sorted=self.enforce_sorted)
        out, state = self.rnn(packed, h0)
        padded, _ = pad_packed_sequence(out, batch_first=self.batch_first, padding_value=-1.0)
        h = state[0] if isinstance(state, tuple) else state
        return torch.cat([padded.flatten(), h.flatten()] + ([state[1].flatten()] if isinstance(state, tuple) else []))


CASES = {
    "rnn": (nn.RNN, dict()),
    "rnn-relu-2layers-bidirectional": (nn.RNN, dict(num_layers=2, nonlinearity="relu", bidirectional=True)),
    "lstm": (nn.LSTM, dict()),
    "lstm-2layers-bidirectional": (nn.LSTM, dict(num_layers=2, bidirectional=True)),
    "lstm-projections": (nn.LSTM, dict(proj_size=2)),
    "gru-2layers-bidirectional": (nn.GRU, dict(num_layers=2, bidirectional=True)),
}


@pytest.mark.parametrize("case, engine", [
    pytest.param(case, engine, marks=[pytest.mark.slow] if engine == "captured" or case in (
        "lstm-2layers-bidirectional", "gru-2layers-bidirectional") else [])
    for case in sorted(CASES) for engine in ("eager", "captured")])
def test_packed_sequences_match_the_reverse_mode_jacobian(case, engine):
    cell, kw = CASES[case]
    torch.manual_seed(0)
    for batch_first, lengths, sorted_ in ((False, [5, 3, 3, 1], True), (True, [2, 5, 1, 4], False)):
        model = PackedRNN(cell, torch.tensor(lengths), batch_first, sorted_, **kw).to(D)
        shape = (4, 5, 3) if batch_first else (5, 4, 3)
        x, u = torch.randn(*shape, dtype=D), torch.randn(*shape, dtype=D)
        for _ in range(2):  # the captured engine: capture, then replay
            y, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
        torch.testing.assert_close(y, model(x), rtol=0, atol=1e-12)
        torch.testing.assert_close(t, reverse_jvp(model, x, u), rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_an_initial_state_with_a_tangent():
    torch.manual_seed(0)
    model = PackedRNN(nn.GRU, torch.tensor([4, 2, 1]), False, num_layers=2).to(D)
    x, u = torch.randn(4, 3, 3, dtype=D), torch.randn(4, 3, 3, dtype=D)
    h0, v = torch.randn(2, 3, 4, dtype=D), torch.randn(2, 3, 4, dtype=D)
    _, t = jvpreg.jvp(model, (x, h0), (u, v))
    _, t_x = torch.autograd.functional.jvp(model, (x, h0), (u, v))
    torch.testing.assert_close(t, t_x, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_parameter_tangents_through_a_packed_lstm():
    torch.manual_seed(0)
    model = PackedRNN(nn.LSTM, torch.tensor([3, 3, 2]), False).to(D)
    x = torch.randn(3, 3, 3, dtype=D)
    names = ["rnn.weight_hh_l0", "rnn.bias_ih_l0"]
    tangents = {n: torch.randn_like(dict(model.named_parameters())[n]) for n in names}
    _, t = jvpreg.jvp_params(model, (x,), tangents)

    def f(*weights):
        return torch.func.functional_call(model, dict(zip(names, weights)), (x,))

    _, t_ref = torch.autograd.functional.jvp(f, tuple(dict(model.named_parameters())[n].detach() for n in names),
                                            tuple(tangents[n] for n in names))
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)


class Lengths(nn.Module):
    """The lengths come with each batch, as in a padded text batch."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4)

    def forward(self, x, lengths):
        out, (h, c) = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return h[-1]


@pytest.mark.slow
def test_batches_of_other_lengths_replay_or_record_their_own_program():
    torch.manual_seed(0)
    model = Lengths().to(D)
    from jvpreg import clone

    for lengths in ([5, 3, 2], [5, 3, 2], [4, 4, 1], [5, 3, 2]):
        x, u = torch.randn(5, 3, 3, dtype=D), torch.randn(1, 5, 3, 3, dtype=D)
        lengths = torch.tensor(lengths)
        (c,), s = clone.pack((x,), (u,))
        with warnings.catch_warnings():
            warnings.simplefilter("error", JVPCaptureWarning)
            _, t = clone.unpack(clone.call(model, (c, lengths), engine="captured"), s, batched=False)
        torch.testing.assert_close(t, reverse_jvp(lambda z: model(z, lengths), x, u[0]), rtol=1e-10, atol=1e-12)
    (prog,) = capture.programs(model).values()
    assert prog.gm is not None and len(prog.variants) == 1


@pytest.mark.slow
def test_lengths_made_in_the_forward_from_a_list_are_captured():
    """``torch.tensor([...])`` in a forward records ``detach_`` of the lifted constant: an in-place op on metadata
    only, so the guard that re-reads the lengths may recompute them (it sent the model to eager clone mode)."""
    torch.manual_seed(0)

    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(3, 4)

        def forward(self, x):
            return self.rnn(pack_padded_sequence(x, torch.tensor([5, 3, 2])))[1][-1]

    model = Fixed().to(D)
    for _ in range(2):
        x, u = torch.randn(5, 3, 3, dtype=D), torch.randn(5, 3, 3, dtype=D)
        with warnings.catch_warnings():
            warnings.simplefilter("error", JVPCaptureWarning)
            _, t = jvpreg.jvp(model, (x,), (u,), engine="captured")
        torch.testing.assert_close(t, reverse_jvp(model, x, u), rtol=1e-10, atol=1e-12)
    (prog,) = capture.programs(model).values()
    assert prog.gm is not None and prog.guards.values is not None


@pytest.mark.parametrize("with_parameter_tangents", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_dropout_between_layers_uses_one_mask_for_every_block(with_parameter_tangents):
    """Train mode: with tangents (u, 2u) in one pass the second JVP is exactly twice the first (one mask for the
    blocks), on the per-block path and on the op-by-op one (taken when a parameter carries a tangent)."""
    torch.manual_seed(0)
    model = PackedRNN(nn.LSTM, torch.tensor([5, 3, 2]), False, num_layers=2, dropout=0.5).to(D).train()
    x, u = torch.randn(5, 3, 3, dtype=D), torch.randn(5, 3, 3, dtype=D)
    torch.manual_seed(1)
    if with_parameter_tangents:
        w = torch.randn_like(model.rnn.weight_hh_l1)
        _, t = jvpreg.jvp_params(model, (x,), {"rnn.weight_hh_l1": torch.stack([w, 2 * w])}, batched_tangents=True)
    else:
        _, t = jvpreg.jvp(model, (x,), (torch.stack([u, 2 * u]),), batched_tangents=True, engine="eager")
    torch.testing.assert_close(t[1], 2 * t[0], rtol=1e-12, atol=1e-12)
    assert t[0].abs().sum() > 0
