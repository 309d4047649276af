"""Value guards (jvpreg.clone.program.value_guard): a captured program whose Python read tensor values replays only for those values.

References: torch.func.jvp in float64, and the eager clone engine where torch.func cannot run the model."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import jvpreg
from jvpreg.clone import JVPCaptureWarning
from jvpreg.clone.program import capture
from jvpreg.clone.program.value_guard import same

D = torch.float64


@pytest.fixture(autouse=True)
def capture_on_first_call(monkeypatch):
    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", 0)
    capture._WARNED.clear()


def randn(*shape):
    return torch.randn(*shape, dtype=D)


class ScaledBy(nn.Module):
    """``x * c`` with ``c`` read into Python from the input's values (``c`` is a constant for autodiff)."""

    def __init__(self, read):
        super().__init__()
        self.read = read

    def forward(self, x):
        return torch.tanh(x) * self.read(x.detach().sum())


READS = {
    "item": lambda t: t.item(),
    "tolist": lambda t: t.tolist(),  # read memory directly: silently baked into the program before the guards
    "numpy": lambda t: float(t.numpy()),
    "dlpack": lambda t: float(np.from_dlpack(t)),
    "float": float,
    "format": lambda t: float(f"{t:.17g}"),
}


def _scaled_jvp(x, u):
    """Explicit ``J u`` of :class:`ScaledBy`: ``(1 - tanh(x)^2) u c`` with ``c = sum(x)``."""
    return (1 - torch.tanh(x) ** 2) * u * float(x.sum())


def _program(model):
    (prog,) = capture.programs(model).values()
    return prog


@pytest.mark.parametrize("read", [r if r == "item" else pytest.param(r, marks=pytest.mark.slow)
                                  for r in sorted(READS)])
def test_a_value_read_by_python_is_guarded_and_every_call_exact(read):
    torch.manual_seed(0)
    model = ScaledBy(READS[read])
    x, u = randn(3, 4), randn(3, 4)
    for _ in range(3):  # the same value: one program, replayed
        _, t = jvpreg.jvp(model, (x,), (u,))
        torch.testing.assert_close(t, _scaled_jvp(x, u), rtol=1e-12, atol=1e-12)
    prog = _program(model)
    assert prog.gm is not None and prog.guards.values is not None and not prog.variants
    for _ in range(2):  # new values: a program recorded for each (up to MAX_VARIANTS), every answer exact
        x = randn(3, 4)
        _, t = jvpreg.jvp(model, (x,), (u,))
        torch.testing.assert_close(t, _scaled_jvp(x, u), rtol=1e-12, atol=1e-12)
    assert len(prog.variants) == 2


@pytest.mark.slow
def test_values_that_change_on_every_call_end_in_eager_mode_with_one_warning():
    torch.manual_seed(0)
    model = ScaledBy(READS["item"])
    u = randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(capture.MAX_VARIANTS + 3):
            x = randn(3, 4)
            _, t = jvpreg.jvp(model, (x,), (u,))
            torch.testing.assert_close(t, _scaled_jvp(x, u), rtol=1e-12, atol=1e-12)
    messages = [str(w.message) for w in caught if issubclass(w.category, JVPCaptureWarning)]
    assert len(messages) == 1 and "Tensor.item" in messages[0] and "differ from call to call" in messages[0]
    assert _program(model).gm is None


class BranchOnSign(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return torch.relu(h) if h.sum() > 0 else torch.tanh(h)


def _jvp_on_branch(model: BranchOnSign, x, u, sign: float) -> None:
    """Push the branch's sum to ``sign`` (the bias), then ``jvpreg.jvp`` with no capture warning, exact against
    ``torch.func.jvp``."""
    with torch.no_grad():
        model.lin.bias.fill_(10.0 * sign)
    with warnings.catch_warnings():
        warnings.simplefilter("error", JVPCaptureWarning)
        _, t = jvpreg.jvp(model, (x,), (u,))
    torch.testing.assert_close(t, torch.func.jvp(model, (x,), (u,))[1], rtol=1e-12, atol=1e-12)


def test_a_branch_on_a_value_gets_one_program_per_branch_and_reuses_them():
    torch.manual_seed(0)
    model = BranchOnSign().to(D)
    x, u = randn(3, 4), randn(3, 4)
    calls = []
    for sign in (1.0, -1.0, 1.0, -1.0, 1.0):
        _jvp_on_branch(model, x, u, sign)
        calls.append(len(_program(model).variants))
    assert calls == [0, 1, 1, 1, 1]
    prog = _program(model)
    assert prog.guards.values.names == ("Tensor.__bool__",)


class ScaleByBranch(nn.Module):
    """Each side of a branch on a value reads another attribute."""

    def __init__(self):
        super().__init__()
        self.a, self.b = 2.0, 3.0

    def forward(self, x):
        return torch.tanh(x) * (self.a if x.sum() > 0 else self.b)


def test_a_program_for_other_values_is_re_checked_against_the_attributes_its_own_trace_read():
    """The program of the negative side read ``self.b``, which the first program (positive side) never read: a
    changed ``b`` must not replay the old one (before, each variant was checked against the first program's reads
    only, and replayed the old ``b``)."""
    model = ScaleByBranch()
    pos, u = torch.ones(2, 3, dtype=D), randn(2, 3)
    for x in (pos, -pos, pos, -pos):
        jvpreg.jvp(model, (x,), (u,))
    assert len(_program(model).variants) == 1
    model.b = 5.0
    for x in (-pos, pos):
        _, t = jvpreg.jvp(model, (x,), (u,))
        torch.testing.assert_close(t, jvpreg.jvp(model, (x,), (u,), engine="eager")[1], rtol=0, atol=0)
    assert len(_program(model).variants) == 2  # one recorded for the new b


ROWS = {  # the rows where a condition holds, as users write it: ops the pre-dispatch tracer keeps whole included
    "nonzero": (lambda c: c.nonzero()[:, 0], "aten.nonzero.default"),
    "where": (lambda c: torch.where(c)[0], "aten.where.default"),  # composite: nonzero inside
    "as_tuple": (lambda c: c.nonzero(as_tuple=True)[0], "aten.nonzero"),
    "argwhere": (lambda c: torch.argwhere(c)[:, 0], "aten.argwhere.default"),
}


class Positives(nn.Module):
    """Rows picked by ``rows`` (``nonzero``, ``torch.where``): the program holds their count in later ops' sizes."""

    def __init__(self, rows=ROWS["nonzero"][0]):
        super().__init__()
        self.rows = rows

    def forward(self, x):
        idx = self.rows(x[:, 0] > 0)
        return torch.zeros(x.shape[0], x.shape[1], dtype=x.dtype).index_add(0, idx, torch.relu(x[idx]) * 2)


@pytest.mark.parametrize("rows", sorted(ROWS))
@pytest.mark.slow
def test_an_output_shape_that_depends_on_values_is_guarded(rows):
    torch.manual_seed(0)
    model = Positives(ROWS[rows][0])
    u = randn(5, 4)
    x = -torch.rand(5, 4, dtype=D) - 0.1  # no positive row when captured: the recorded count is 0
    for count in (0, 3, 1, 3, 0):
        x = x.abs() * torch.tensor([1.0] * count + [-1.0] * (5 - count), dtype=D)[:, None]
        y, t = jvpreg.jvp(model, (x,), (u,))
        y_ref, t_ref = jvpreg.jvp(model, (x,), (u,), engine="eager")
        assert torch.equal(y, y_ref) and torch.equal(t, t_ref)
        torch.testing.assert_close(t, torch.func.jvp(model, (x,), (u,))[1], rtol=1e-12, atol=1e-12)
    prog = _program(model)
    assert any(name.startswith("the shape of " + ROWS[rows][1]) for name in prog.guards.values.names)
    assert len(prog.variants) == 2  # counts 0, 3 and 1


VALUE_SHAPED = {  # user code whose tensors' shapes follow values: every pattern here crashed or gave a wrong shape
    # on a replay before composite ops were checked for value-dependent shapes inside (see test_guards history)
    "nonzero as_tuple": lambda x: torch.tanh(x[torch.nonzero(x > 0, as_tuple=True)]),
    "unique_consecutive": lambda x: torch.tanh(x)[:torch.unique_consecutive((x[:, 0] > 0).long()).numel()],
    "where condition": lambda x: torch.tanh(x[torch.where(x[:, 0] > 0)[0]]),
    "masked_select": lambda x: torch.tanh(x[x > 0]).sum(0, keepdim=True) * x[:1],
    "repeat_interleave counts": lambda x: torch.repeat_interleave(torch.tanh(x), (x[:, 0] > 0).long() + 1, dim=0),
    "bincount": lambda x: torch.tanh(x[:torch.bincount((x[:, 0] > 0).long().cumsum(0)).shape[0]]),
    "unique": lambda x: torch.tanh(x)[torch.unique((x[:, 0] > 0).long() + (x[:, 1] > 0).long())],
}


class Function(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("bincount", "masked_select") else n
                                  for n in sorted(VALUE_SHAPED)])
def test_value_dependent_shapes_replay_exactly_on_other_values(name):
    model = Function(VALUE_SHAPED[name])
    for seed, positives in enumerate((2, 2, 4, 1, 5)):  # rows whose first two entries are positive
        g = torch.Generator().manual_seed(seed % 4)
        x = torch.randn(5, 4, dtype=D, generator=g)
        x[:, :2] = x[:, :2].abs() * torch.tensor([1.0] * positives + [-1.0] * (5 - positives), dtype=D)[:, None]
        u = torch.randn(5, 4, dtype=D, generator=g)
        y, t = jvpreg.jvp(model, (x,), (u,), engine="captured")
        y_ref, t_ref = torch.func.jvp(model.f, (x,), (u,))
        assert y.shape == y_ref.shape and t.shape == t_ref.shape
        torch.testing.assert_close(t, t_ref, rtol=1e-12, atol=1e-12)
    prog = _program(model)
    assert prog.gm is not None and len(prog.variants) >= 1  # other counts: other programs, each exact


class MaskedMean(nn.Module):
    """A padding mask in a module attribute, read by Python (as Hugging Face's SDPA mask preparation does)."""

    def __init__(self, mask):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mask = mask

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.mask.all():
            return h.mean(1)
        m = self.mask[..., None].to(h.dtype)
        return (h * m).sum(1) / m.sum(1)


def test_a_constant_changed_in_place_is_re_checked():
    torch.manual_seed(0)
    mask = torch.ones(2, 5, dtype=torch.bool)
    model = MaskedMean(mask).to(D)
    x, u = randn(2, 5, 4), randn(2, 5, 4)
    for pad in (0, 2, 0):
        mask.fill_(True)
        mask[1, 5 - pad:] = False
        _, t = jvpreg.jvp(model, (x,), (u,))
        torch.testing.assert_close(t, torch.func.jvp(model, (x,), (u,))[1], rtol=1e-12, atol=1e-12)
    assert len(_program(model).variants) == 1


class BranchAfterBatchNorm(nn.Module):
    """A train-mode BatchNorm, then a branch on ``read(self, x)``."""

    def __init__(self, read):
        super().__init__()
        self.bn, self.read = nn.BatchNorm1d(4), read

    def forward(self, x):
        h = self.bn(x)
        return torch.relu(h) if self.read(self, x) > 0 else torch.tanh(h)


def running_mean_sum(model, x):  # a buffer the forward just updated in place
    return model.bn.running_mean.sum()


def first_input(model, x):  # the input's values: the guard runs before the replay's update
    return x[0, 0]


def test_a_value_the_forward_writes_in_place_is_not_guarded_but_run_eagerly():
    torch.manual_seed(0)
    model = BranchAfterBatchNorm(running_mean_sum).to(D).train()
    reference = BranchAfterBatchNorm(running_mean_sum).to(D).train()
    x, u = randn(6, 4), randn(6, 4)
    with pytest.warns(JVPCaptureWarning, match="changes in place"):
        _, t = jvpreg.jvp(model, (x,), (u,))
    _, t_ref = jvpreg.jvp(reference, (x,), (u,), engine="eager")
    assert torch.equal(t, t_ref)
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)


class TwoLayerRouter(nn.Module):
    """Mixture-of-Experts routing as Hugging Face's eager experts write it: top-2 weights renormalised in place
    (``top /= ...``), the output accumulated in place into ``zeros`` (``index_add_``), and the next layer's routing,
    read by Python (``nonzero``, ``bool``), computed from that output."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 3, bias=False)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def layer(self, x):
        top, chosen = torch.topk(torch.softmax(self.router(x), -1), 2, dim=-1)
        top /= top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        mask = nn.functional.one_hot(chosen, 3).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, tokens = torch.where(mask[e[0]])
            out.index_add_(0, tokens, torch.tanh(self.experts[e[0]](x[tokens])) * top[tokens, slot, None])
        return out

    def forward(self, x):
        return self.layer(x + self.layer(x))


@pytest.mark.slow
def test_values_computed_from_tensors_the_forward_writes_in_place_are_guarded():
    """The guard replays the writes into tensors the forward made (``top /= ...``, ``out.index_add_``) before the
    read: captured, and exact on inputs that route differently."""
    torch.manual_seed(0)
    model = TwoLayerRouter().to(D)
    u = randn(6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", JVPCaptureWarning)
        for seed in (0, 0, 1, 2, 1):
            x = torch.randn(6, 4, dtype=D, generator=torch.Generator().manual_seed(seed)) * 3
            _, t = jvpreg.jvp(model, (x,), (u,))
            torch.testing.assert_close(t, torch.func.jvp(model, (x,), (u,))[1], rtol=1e-12, atol=1e-12)
    prog = _program(model)
    assert prog.gm is not None and len(prog.variants) == 2  # three routings, each recorded once
    guard_ops = {n.target for n in prog.guards.values.fn.__self__.graph.nodes}
    assert torch.ops.aten.copy_.default in guard_ops  # the write into ``out``, replayed by the guard


class BranchOnAccumulated(nn.Module):
    """A branch on the sum of a tensor filled in place (``zeros``, then ``index_add_``)."""

    def forward(self, x):
        out = torch.zeros_like(x)
        out.index_add_(0, torch.tensor([0, 2, 1]), torch.tanh(x))
        return torch.relu(x) * out if out.sum() > 0 else torch.tanh(x) * out


@pytest.mark.slow
def test_a_branch_on_a_tensor_filled_in_place_replays_the_program_recorded_for_each_side():
    torch.manual_seed(0)
    model = BranchOnAccumulated()
    x, u = randn(3, 4), randn(3, 4)
    variants = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", JVPCaptureWarning)
        for sign in (1.0, -1.0, 1.0, -1.0):
            _, t = jvpreg.jvp(model, (sign * x,), (u,))
            torch.testing.assert_close(t, torch.func.jvp(model, (sign * x,), (u,))[1], rtol=1e-12, atol=1e-12)
            variants.append(len(_program(model).variants))
    assert variants == [0, 1, 1, 1]


class ReadThenWritten(nn.Module):
    """A one-element tensor read by Python, then changed in place: the guard cannot tell which value the read saw."""

    def forward(self, x):
        s = torch.tanh(x).sum().clone()
        flag = bool(s > 0) if self.compare else float(s)
        s.mul_(2.0)
        return torch.tanh(x) * s if flag else x * s

    compare = False


class DrawnThenRead(nn.Module):
    """A value read from a random draw (``bernoulli_``): no guard can re-check it."""

    def forward(self, x):
        keep = torch.empty_like(x).bernoulli_(0.5)
        return torch.tanh(x) * keep * float(keep.sum())


@pytest.mark.parametrize("model, message", [(ReadThenWritten(), "after it is made"), (DrawnThenRead(), "random")])
def test_a_read_no_guard_can_re_check_runs_eagerly_with_a_warning_that_says_why(model, message):
    x, u = randn(3, 4), randn(3, 4)
    with pytest.warns(JVPCaptureWarning, match=message):
        torch.manual_seed(0)
        _, t = jvpreg.jvp(model, (x,), (u,))
    torch.manual_seed(0)
    _, t_ref = jvpreg.jvp(model, (x,), (u,), engine="eager")
    assert torch.equal(t, t_ref)


@pytest.mark.slow
def test_running_statistics_are_updated_once_per_call_whichever_program_runs():
    torch.manual_seed(0)
    model = BranchAfterBatchNorm(first_input).to(D).train()
    reference = BranchAfterBatchNorm(first_input).to(D).train()
    u = randn(6, 4)
    for sign in (1.0, -1.0, -1.0, 1.0):
        x = randn(6, 4)
        x[0, 0] = sign
        _, t = jvpreg.jvp(model, (x,), (u,))
        _, t_ref = jvpreg.jvp(reference, (x,), (u,), engine="eager")
        assert torch.equal(t, t_ref)
        assert torch.equal(model.bn.running_mean, reference.bn.running_mean)
        assert torch.equal(model.bn.running_var, reference.bn.running_var)
    assert len(_program(model).variants) == 1


def test_gradients_through_a_guarded_program_are_exact():
    torch.manual_seed(0)
    model = BranchOnSign().to(D)
    x, u = randn(3, 4), randn(3, 4)
    for sign in (1.0, -1.0):
        with torch.no_grad():
            model.lin.bias.fill_(10.0 * sign)
        grads = []
        for engine in ("captured", "eager"):
            model.zero_grad()
            _, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
            t.pow(2).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for a, b in zip(*grads):
            assert torch.equal(a, b)


def test_same_compares_nan_as_equal_and_nothing_else():
    assert same([1.0, float("nan")], [1.0, float("nan")])
    assert not same([1.0, 2.0], [1.0, 2.5])
    assert not same([1.0], [1.0, 1.0])
    assert same(True, True) and not same(True, False)


@pytest.mark.slow
def test_hugging_face_padding_masks_are_captured_with_a_guard():
    import transformers
    from jvpreg import clone

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32)
    bert = transformers.BertModel(config).to(D).eval()

    class LastHidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, x, mask):
            return self.bert(inputs_embeds=x, attention_mask=mask).last_hidden_state

    model = LastHidden()
    for pad in (0, 2, 3, 0):
        mask = torch.ones(3, 6, dtype=torch.long)
        mask[1, 6 - pad:] = 0
        x, u = randn(3, 6, 16), randn(1, 3, 6, 16)
        outs = []
        for engine in ("captured", "eager"):
            (c,), s = clone.pack((x,), (u,))
            with warnings.catch_warnings():
                warnings.simplefilter("error", JVPCaptureWarning)
                outs.append(clone.unpack(clone.call(model, (c, mask), engine=engine), s))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    prog = _program(model)
    assert prog.gm is not None and len(prog.variants) == 1  # padded and unpadded batches


def test_auto_records_a_program_for_other_values_only_when_they_recur(monkeypatch):
    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", 1)
    torch.manual_seed(0)
    model = BranchOnSign().to(D)
    x, u = randn(3, 4), randn(3, 4)
    variants = []
    for sign in (1.0, 1.0, -1.0, 1.0, -1.0, -1.0):
        _jvp_on_branch(model, x, u, sign)
        progs = capture.programs(model)
        variants.append(len(next(iter(progs.values())).variants) if progs else None)
    # eager, captured, eager (new value), replayed, captured (the value recurred), replayed
    assert variants == [None, 0, 0, 0, 1, 1]


def test_auto_gives_up_on_values_that_never_recur_without_recording_them(monkeypatch):
    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", 1)
    torch.manual_seed(0)
    model = ScaledBy(READS["item"])
    u = randn(3, 4)
    x = randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(capture.MAX_MISSED_VALUES + 4):
            x = x if i < 2 else randn(3, 4)  # the first value twice (captured), then a new one every call
            _, t = jvpreg.jvp(model, (x,), (u,))
            torch.testing.assert_close(t, _scaled_jvp(x, u), rtol=1e-12, atol=1e-12)
    assert len([w for w in caught if issubclass(w.category, JVPCaptureWarning)]) == 1
    assert _program(model).gm is None


class PaddedByCount(nn.Module):
    """A one-element tensor passed where torch expects a number (a size): read inside the C++ call."""

    def forward(self, x):
        count = (x[:, 0] > 0).sum()
        return torch.cat([torch.tanh(x), torch.zeros(x.shape[0], count, dtype=x.dtype)], 1)


@pytest.mark.slow
def test_a_tensor_passed_as_a_number_is_read_and_guarded():
    torch.manual_seed(0)
    model = PaddedByCount()
    u = randn(4, 3)
    for count in (2, 2, 3, 0):
        x = randn(4, 3).abs() * torch.tensor([1.0] * count + [-1.0] * (4 - count), dtype=D)[:, None]
        y, t = jvpreg.jvp(model, (x,), (u,))
        assert y.shape == (4, 3 + count)
        expected = torch.cat([(1 - torch.tanh(x) ** 2) * u, torch.zeros(4, count, dtype=D)], 1)
        torch.testing.assert_close(t, expected, rtol=1e-12, atol=1e-12)
    prog = _program(model)
    assert prog.gm is not None and len(prog.variants) == 2


def test_a_packed_lstm_training_step_is_captured_with_no_guard_on_its_shape():
    """``aten.lstm.data`` reads ``batch_sizes`` in C++ (fake tensors cannot run it) and carries the random tag
    (dropout): counted as a value-shaped op, its guard could not be replayed and the step ran eagerly. Its output
    has the packed input's rows: no shape guard, the step is captured, its gradients those of the eager engine."""
    from jvpreg.bench.capture import _PackedRecurrent
    from jvpreg.losses import ParameterSensitivity, regularized_forward

    grads = []
    for engine in ("auto", "eager"):
        torch.manual_seed(0)
        model = _PackedRecurrent(nn.LSTM).to(D).train()
        penalty = ParameterSensitivity(params=("*weight",))
        x, y = randn(4, 8, 32), torch.tensor([0, 1, 2, 3])
        with warnings.catch_warnings():
            warnings.simplefilter("error", JVPCaptureWarning)
            for _ in range(3):
                model.zero_grad()
                torch.manual_seed(1)
                out, value = regularized_forward(model, x, penalty, target=y, engine=engine)
                (nn.functional.cross_entropy(out, y) + 0.1 * value).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if engine == "auto":
            prog = _program(model)
            assert prog.gm is not None and not any("lstm" in name for name in prog.guards.values.names)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
