"""Python state a forward changes besides its tensors (``jvpreg.clone.program.side_effects``): a captured program would not
change it, so such a forward runs in eager clone mode and changes it exactly as an eager call does."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import jvpreg
from jvpreg.clone import JVPCaptureWarning
from jvpreg.clone.program import capture
from jvpreg.clone.program.side_effects import Attributes
from jvpreg.clone.core.tensor import raw
from conftest import assert_as_plain, count_captures

D = torch.float64


def randn(*shape):
    return torch.randn(*shape, dtype=D)


def _calls(model, x, u, engine):
    """One JVP; the ``JVPCaptureWarning`` messages it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
    return y, t, [str(w.message) for w in caught if issubclass(w.category, JVPCaptureWarning)]


class _Recording(nn.Module):
    """Counts its calls and keeps its last hidden state, as monitoring code does."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.calls = 0

    def forward(self, x):
        h = torch.relu(self.lin(x))
        self.calls += 1
        self.head.last = h.detach()
        return self.head(h)


def test_forward_that_sets_attributes_runs_eagerly_and_sets_them_as_eager_calls_do():
    """Before: the program replayed the tensor ops only, so ``calls`` stayed at 1 and ``last`` at the capturing call's
    tensor for every later call, silently."""
    capture._WARNED.clear()
    torch.manual_seed(0)
    model, eager = _Recording().to(D), _Recording().to(D)
    eager.load_state_dict(model.state_dict())
    u = randn(4, 6)
    for call in range(3):
        x = randn(4, 6)
        y_e, t_e = jvpreg.jvp(eager, (x,), (u,), engine="eager")
        y_c, t_c, said = _calls(model, x, u, "captured")
        if call == 0:
            assert len(said) == 1 and "sets Python attributes or module globals (_Recording.calls, head.last)" in said[0], said
        else:
            assert said == []
        torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
        torch.testing.assert_close(t_c, t_e, rtol=0, atol=0)
        assert model.calls == eager.calls == call + 1  # once per call: the trace's write was taken back
        assert torch.equal(raw(model.head.last), raw(eager.head.last))  # this call's clone batch, as eager keeps it
    assert [p.gm is not None for p in capture.programs(model).values()] == [False]


class _Flagged(nn.Module):
    """Sets the same flag, name and dtype on every call: a replay that does not set them leaves what a call would."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        self.seen_input, self.mode, self.dtype_seen, self.shape_seen = True, "jvp", x.dtype, tuple(x.shape)
        return torch.tanh(self.lin(x))


def test_writes_of_equal_values_keep_the_program():
    model = _Flagged().to(D)
    x, u = randn(4, 6), randn(4, 6)
    model(x)  # the attributes exist before the capture
    for _ in range(2):
        _, _, said = _calls(model, x, u, "captured")
        assert said == []
    assert [p.gm is not None for p in capture.programs(model).values()] == [True]


class _Cached(nn.Module):
    """Builds a table on its first call only (a rotary embedding's cache)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.linspace(0, 1, 3, dtype=x.dtype)
        return self.lin(x) * self.table


def test_a_cache_set_on_the_first_call_is_kept_and_reset_captures_after_it():
    capture._WARNED.clear()
    model = _Cached().to(D)
    x, u = randn(4, 6), randn(4, 6)
    _, t_first, said = _calls(model, x, u, "captured")
    assert len(said) == 1 and "_Cached.table" in said[0] and "reset(model)" in said[0]
    assert torch.equal(model.table, torch.linspace(0, 1, 3, dtype=D))  # set once, by the eager run
    capture.reset(model)
    _, t, said = _calls(model, x, u, "captured")
    assert said == []
    torch.testing.assert_close(t, t_first, rtol=0, atol=0)
    assert [p.gm is not None for p in capture.programs(model).values()] == [True]


def test_spectral_norm_weight_recomputed_by_its_hook_keeps_the_program():
    """Spectral norm's pre-hook sets ``module.weight`` on every call from tensors the program computes."""
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(6, 8)), nn.ReLU(), nn.Linear(8, 3)).to(D).eval()
    x, u = randn(4, 6), randn(4, 6)
    for _ in range(2):
        _, t, said = _calls(model, x, u, "captured")
        assert said == []
    _, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)
    assert [p.gm is not None for p in capture.programs(model).values()] == [True]


def test_attributes_snapshot_names_and_restores_every_kind_of_write():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    model.register_buffer("buf", torch.zeros(2))
    snap = Attributes(model)
    old_weight, old_relu, old_buf = model[0].weight, model[1], model.buf
    model.new_attribute = 1                       # added
    model[0].weight = nn.Parameter(torch.ones(2, 2))  # a parameter rebound
    model[1] = nn.Identity()                      # a submodule replaced
    model.buf = torch.ones(2)                     # a buffer rebound
    model[0].in_features = 2                      # the same number: no change
    assert snap.changed() == ["0.weight", "Sequential.1", "Sequential.buf", "Sequential.new_attribute"]
    snap.restore()
    assert snap.changed() == []
    assert not hasattr(model, "new_attribute")
    assert model[0].weight is old_weight and model[1] is old_relu and model.buf is old_buf


class _Logging(nn.Module):
    """Appends its hidden state to a list and files it in a dict, as monitoring code does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.log, self.by_shape, self.fixed = [], {}, [1, 2]

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        self.log.append(h.detach())
        self.by_shape[tuple(x.shape)] = h.detach()
        self.fixed[0] = 1  # the same number: no change
        return h


def test_a_forward_that_writes_into_a_list_or_dict_runs_eagerly_and_writes_once_per_call():
    """Before: the trace's append was taken back with nothing named, so the program captured and its replays never
    appended: the log stopped growing, silently."""
    capture._WARNED.clear()
    torch.manual_seed(0)
    model, eager = _Logging().to(D), _Logging().to(D)
    eager.load_state_dict(model.state_dict())
    x = randn(4, 6)
    for call in range(3):
        u = randn(4, 6)
        _, t_e = jvpreg.jvp(eager, (x,), (u,), engine="eager")
        _, t_c, said = _calls(model, x, u, "captured")
        if call == 0:
            assert len(said) == 1 and "(_Logging.by_shape[...], _Logging.log[...])" in said[0], said
        torch.testing.assert_close(t_c, t_e, rtol=0, atol=0)
        assert len(model.log) == len(eager.log) == call + 1  # once per call: the trace's append was taken back
        assert all(type(h) is torch.Tensor and torch.equal(h, g) for h, g in zip(model.log, eager.log))
        assert list(model.by_shape) == [(4, 6)] and torch.equal(model.by_shape[(4, 6)], eager.by_shape[(4, 6)])
    assert [p.gm is not None for p in capture.programs(model).values()] == [False]


def test_attributes_snapshot_names_and_restores_the_items_of_lists_and_dicts():
    model = nn.Linear(2, 2)
    model.log, model.table, model.same = [torch.zeros(1)], {"a": 1}, [1.0, "x"]
    log, table, first = model.log, model.table, model.log[0]
    snap = Attributes(model)
    model.log.append(torch.ones(1))
    model.table["a"], model.table["b"] = 2, 3
    model.same[0] = 1.0   # an equal number: no change
    assert snap.changed() == ["Linear.log[...]", "Linear.table[...]"]
    snap.restore()
    assert snap.changed() == []
    assert model.log is log and model.log == [first] and model.table is table and model.table == {"a": 1}
    model.log = [torch.ones(1)]  # rebound: named once, by the attribute
    assert snap.changed() == ["Linear.log"]


class _AuxLosses(nn.Module):
    """Appends an auxiliary loss to the list it is passed and notes its hidden state on an options object, as a
    mixture of experts' load-balancing loss is collected."""

    def __init__(self, writes):
        super().__init__()
        self.lin, self.head, self.writes = nn.Linear(6, 8), nn.Linear(8, 3), writes

    def forward(self, x, aux, opts):
        h = torch.tanh(self.lin(x))
        if self.writes == "list":
            aux.append(h.pow(2).mean())
        else:
            opts.last = h.detach()
        return self.head(h)


class _Opts:
    pass


@pytest.mark.parametrize("writes, said_when_captured", [("list", "writes into a list or dict it is given"),
                                                         ("object", "module globals (argument _Opts.last)")])
@pytest.mark.parametrize("engine", ["auto", "captured", "eager"])
def test_a_forward_that_writes_into_what_it_is_passed_writes_plain_values_once_per_call(engine, writes,
                                                                                       said_when_captured):
    """The callbacks' path. Before: the trace wrote into its own copy of the list, so the program captured and its
    replays never appended (the auxiliary loss silently left out of training); the eager calls appended a clone
    batch, which the training loss could not read."""
    from jvpreg.callbacks.shared import SharedForward
    from jvpreg.losses import JacobianFrobenius

    capture._WARNED.clear()
    torch.manual_seed(0)
    model, plain = _AuxLosses(writes).to(D), _AuxLosses(writes).to(D)
    plain.load_state_dict(model.state_dict())
    shared = SharedForward(model, engine=engine)
    said_all = []
    for _ in range(3):
        x = randn(4, 6)
        aux, opts, aux_plain, opts_plain = [], _Opts(), [], _Opts()
        shared.arm([(JacobianFrobenius(1), 1.0, 1.0)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(x, aux, opts)
            shared.total()
        shared.disarm()
        said = [str(w.message) for w in caught if issubclass(w.category, JVPCaptureWarning)]
        torch.testing.assert_close(out, plain(x, aux_plain, opts_plain), rtol=0, atol=1e-12)
        if writes == "list":
            assert len(aux) == 1 and type(aux[0]) is torch.Tensor and aux[0].requires_grad
            torch.testing.assert_close(aux[0], aux_plain[0], rtol=0, atol=1e-12)
        else:
            assert type(opts.last) is torch.Tensor and torch.allclose(opts.last, opts_plain.last, rtol=0, atol=1e-12)
        said_all += said
    if engine == "captured":  # auto: a new options object is a new call signature, which runs eagerly first
        assert len(said_all) == 1 and said_when_captured in said_all[0], said_all
    else:
        assert said_all == [], said_all
    assert all(p.gm is None for p in capture.programs(model).values())


def test_an_argument_objects_fields_are_in_the_attributes_snapshot():
    model, opts = nn.Linear(2, 2), _Opts()
    opts.scale = 1.0
    snap = Attributes(model, [opts])
    opts.scale, opts.last = 2.0, torch.ones(1)
    assert snap.changed() == ["argument _Opts.last", "argument _Opts.scale"]
    snap.restore()
    assert vars(opts) == {"scale": 1.0}


def test_clone_batches_passed_in_a_list_stay_in_it():
    """``jvpreg.clone.call(model, ([x_clone],))``: the caller's list holds its clone input after the call."""
    class SumOfList(nn.Module):
        def forward(self, xs, opts):
            xs.append(xs[0].sin())
            xs[1][0].append(xs[1][0][0].cos())
            return xs[0] * xs[2] * xs[1][0][1] + opts.w

    x, u = randn(3, 2), randn(1, 3, 2)
    (xc, zc, wc), _ = jvpreg.clone.pack((x, x + 1, x + 2), (u, u, u))
    xs, opts = [xc, ([zc],)], _Opts()  # a clone input in a list inside a tuple inside the list too
    opts.w = wc  # and one an object passed in holds
    jvpreg.clone.call(SumOfList(), (xs, opts), engine="eager")
    assert xs[0] is xc and xs[1][0][0] is zc and opts.w is wc
    assert type(xs[2]) is torch.Tensor and torch.equal(xs[2], x.sin())
    assert type(xs[1][0][1]) is torch.Tensor and torch.equal(xs[1][0][1], (x + 1).cos())


class _Layer:
    def __init__(self):
        self.keys = torch.zeros(0)


class _Cache:
    """A key cache that is no pytree node, as Hugging Face's ``DynamicCache``: its layers' tensors are fields."""

    def __init__(self):
        self.layers = [_Layer()]


class _ReturnsCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        cache = _Cache()
        cache.layers[0].keys = torch.cat([cache.layers[0].keys.to(h).reshape(0, 6), h.exp()])
        return {"out": h, "cache": cache}


@pytest.mark.parametrize("engine", ["captured", "eager"])
def test_an_object_holding_tensors_returned_by_the_forward_holds_the_plain_forwards_tensors(engine):
    """Before: the captured program returned the capture's own object on every replay (tensors of that call, clone
    batches), and an eager call returned clone batches inside it."""
    capture._WARNED.clear()
    torch.manual_seed(0)
    model = _ReturnsCache().to(D)
    said_all = []
    for _ in range(3):
        x, u = randn(4, 6), randn(4, 6)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
        said_all += [str(w.message) for w in caught if issubclass(w.category, JVPCaptureWarning)]
        keys = y["cache"].layers[0].keys
        assert_as_plain(keys, model(x)["cache"].layers[0].keys, "cache keys")
        torch.testing.assert_close(t["out"], torch.func.jvp(lambda z: model(z)["out"], (x,), (u,))[1])
    if engine == "captured":
        assert len(said_all) == 1 and "returns an object holding tensors (_Cache)" in said_all[0], said_all
        assert "use_cache=False" in said_all[0]
    else:
        assert said_all == []


@pytest.mark.slow
def test_hugging_face_cache_returned_by_gpt2_holds_the_plain_forwards_keys():
    import transformers
    from jvpreg.callbacks.shared import SharedForward
    from jvpreg.losses import JacobianFrobenius

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=20, n_positions=16)
    model = transformers.GPT2Model(cfg).to(D).eval()
    shared = SharedForward(model, engine="auto", input_key="inputs_embeds")
    for _ in range(3):
        x = randn(2, 5, 16)
        shared.arm([(JacobianFrobenius(1, output_key="last_hidden_state"), 1.0, 1.0)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model(inputs_embeds=x, use_cache=True)
            shared.total()
        shared.disarm()
        got, want = out.past_key_values, model(inputs_embeds=x, use_cache=True).past_key_values
        got_k = got.layers[0].keys if hasattr(got, "layers") else got[0][0]
        want_k = want.layers[0].keys if hasattr(want, "layers") else want[0][0]
        assert type(got_k) is torch.Tensor and torch.allclose(got_k, want_k, rtol=0, atol=1e-12)


@pytest.mark.parametrize("engine", ["auto", "compiled"])
def test_every_engine_that_captures_checks_the_writes(engine, monkeypatch):
    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", 0)
    capture._WARNED.clear()
    model = _Recording().to(D)
    x, u = randn(4, 6), randn(4, 6)
    for _ in range(2):
        _calls(model, x, u, engine)
    assert model.calls == 2
    assert [p.gm is not None for p in capture.programs(model).values()] == [False]


class _Configurable(nn.Module):
    """A forward steered by plain attributes: a slope, a flag and an activation function."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(6, 8), nn.LayerNorm(8)
        self.act, self.residual = torch.tanh, False
        self.leaky = nn.LeakyReLU(0.1)

    def forward(self, x):
        h = self.leaky(self.norm(self.lin(x)))
        h = self.act(h)
        return h + self.lin(x) if self.residual else h


@pytest.mark.parametrize("change", ["slope", "eps", "flag", "function", "dropout_p"])
def test_a_changed_attribute_that_the_forward_reads_recaptures(change):
    """Before: the program kept the values of the capturing call (a slope of 0.1 after it was set to 0.3: wrong JVP,
    silently)."""
    torch.manual_seed(0)
    model = _Configurable().to(D)
    if change == "dropout_p":
        model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3)).to(D).train()
    x, u = randn(4, 6), randn(4, 6)
    for _ in range(2):
        _calls(model, x, u, "captured")
    if change == "slope":
        model.leaky.negative_slope = 0.3
    elif change == "eps":
        model.norm.eps = 0.5
    elif change == "flag":
        model.residual = True
    elif change == "function":
        model.act = torch.sigmoid
    else:
        model[1].p = 0.0  # no dropout: the output is deterministic
    state = torch.get_rng_state()
    with count_captures() as n:
        y, t, said = _calls(model, x, u, "captured")
    torch.set_rng_state(state)
    y_e, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    assert said == []
    torch.testing.assert_close(y, y_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)
    assert n.recorded == 1, f"the changed {change} was not recaptured: {n}"  # recaptured for the new value, and run
    n.ran_programs(1)
    assert all(p.gm is not None for p in capture.programs(model).values())


def test_attributes_read_are_recorded_by_value_and_the_classes_are_put_back():
    model = _Configurable().to(D)
    classes = [type(m) for m in model.modules()]
    _calls(model, randn(4, 6), randn(4, 6), "captured")
    assert [type(m) for m in model.modules()] == classes
    (prog,) = capture.programs(model).values()
    read = {name: (value, by_value) for _, name, value, by_value, _ in prog.guards.attributes}
    assert read["negative_slope"] == (0.1, True) and read["eps"] == (1e-5, True)
    assert read["normalized_shape"] == ((8,), True) and read["residual"] == (False, True)
    assert read["act"] == (torch.tanh, False)  # a function: by identity
    assert "training" not in read and "_parameters" not in read  # nn.Module's own state: guarded apart


@pytest.mark.parametrize("held", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["module_attribute", "held_object_field"])
def test_an_attribute_changed_on_every_call_runs_eagerly_after_a_few_recaptures(monkeypatch, held):
    """The warning names the attribute: a module's own, or a field of an object it holds (``settings.slope``)."""
    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", 0)
    capture._WARNED.clear()
    model = (_SteeredBySettings() if held else _Configurable()).to(D)
    x, u = randn(4, 6), randn(4, 6)
    said_all = []
    for i in range(capture.MAX_VARIANTS + 3):
        setattr(model.settings if held else model.leaky, "slope" if held else "negative_slope", 0.1 * (i + 1))
        _, t, said = _calls(model, x, u, "auto")
        said_all += said
        _, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
        torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)
    name = "settings.slope" if held else "negative_slope"
    assert len(said_all) == 1 and f"attributes its forward reads ({name}) change every few calls" in said_all[0]
    assert [p.gm is not None for p in capture.programs(model).values()] == [False]


@pytest.mark.slow
def test_an_attribute_changed_now_and_then_recaptures_each_time(monkeypatch):
    """An annealed dropout p, a slope changed every few epochs: each change after a steady stretch recaptures."""
    monkeypatch.setattr(capture, "EAGER_CALLS_BEFORE_CAPTURE", 0)
    model = _Configurable().to(D)
    x, u = randn(4, 6), randn(4, 6)
    for change in range(capture.MAX_VARIANTS + 2):
        model.leaky.negative_slope = 0.1 * (change + 1)
        for _ in range(capture.STEADY_REPLAYS):
            _, t, said = _calls(model, x, u, "auto")
            assert said == []
        _, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
        torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)
    (prog,) = capture.programs(model).values()
    assert prog.gm is not None and prog.replays == capture.STEADY_REPLAYS


def test_a_forward_that_raises_not_implemented_raises_it_and_its_trace_puts_the_classes_back():
    """The capture takes a tracer's NotImplementedError (an argument it cannot record) for a reason to run eagerly;
    the forward's own is raised again by that eager run, and the recording classes are put back all the same."""
    class Unfinished(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x):
            raise NotImplementedError("this model's forward is not written yet")

    model = Unfinished()
    with pytest.raises(NotImplementedError, match="not written yet"), warnings.catch_warnings():
        warnings.simplefilter("ignore", JVPCaptureWarning)
        jvpreg.jvp(model, (randn(2, 6).float(),), (randn(2, 6).float(),), engine="captured")
    assert type(model) is Unfinished and type(model.lin) is nn.Linear


class _Offset:
    def __init__(self):
        self.shift = 0.0


class _Settings:
    """A plain object a module holds (as a Hugging Face model holds its config)."""

    def __init__(self):
        self.slope, self.residual = 0.1, False
        self.gains = {"out": 1.0}
        self.inner = _Offset()


class _SteeredBySettings(nn.Module):
    scale = 2.0  # a class constant the forward reads

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.settings = _Settings()

    def forward(self, x):
        h = nn.functional.leaky_relu(self.lin(x), self.settings.slope) * (self.scale * self.settings.gains["out"])
        return h + self.lin(x) if self.settings.residual else h


@pytest.mark.parametrize("change", ["held_field", "held_flag", "held_dict_item", "shadowed_constant",
                                    "class_constant"])
def test_a_changed_field_of_a_held_object_or_class_constant_recaptures(change):
    """Before: only the held object's identity and the instance's own attributes were re-checked (a slope changed in
    the module's settings object: wrong JVP, silently)."""
    torch.manual_seed(0)
    model = _SteeredBySettings().to(D)
    x, u = randn(4, 6), randn(4, 6)
    for _ in range(2):
        _calls(model, x, u, "captured")
    if change == "held_field":
        model.settings.slope = 0.3
    elif change == "held_flag":
        model.settings.residual = True
    elif change == "held_dict_item":
        model.settings.gains["out"] = 0.5  # in place: a dict of numbers is compared by value
    elif change == "shadowed_constant":
        model.scale = 3.0
    try:
        if change == "class_constant":
            _SteeredBySettings.scale = 3.0
        y, t, said = _calls(model, x, u, "captured")
        y_e, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    finally:
        _SteeredBySettings.scale = 2.0
    assert said == []
    torch.testing.assert_close(y, y_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)
    (prog,) = capture.programs(model).values()
    labels = {label for *_, label in prog.guards.attributes}
    assert {"settings", "settings.slope", "settings.residual", "scale"} <= labels


def test_a_forward_that_sets_a_field_of_a_held_object_runs_eagerly_and_sets_it_once_per_call():
    class Counting(_SteeredBySettings):
        def forward(self, x):
            self.settings.calls = getattr(self.settings, "calls", 0) + 1
            return super().forward(x)

    model = Counting().to(D)
    x, u = randn(4, 6), randn(4, 6)
    said = []
    for _ in range(3):
        said += _calls(model, x, u, "captured")[2]
    assert model.settings.calls == 3  # the trace's write was put back; each (eager) call wrote once
    assert said and "sets Python attributes or module globals (Counting.settings.calls)" in said[0]


@pytest.mark.slow
def test_hugging_face_config_changed_after_a_capture_recaptures():
    """``config.output_hidden_states`` steers a Hugging Face forward; before, a replay returned the old outputs (the
    last layer's, 0.03 off). Now the call recaptures, and as Hugging Face then records the hidden states by forward
    hooks, it runs eagerly."""
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    bert = transformers.BertModel(config).to(D).eval()

    class FirstLayerOrLast(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, e):
            out = self.bert(inputs_embeds=e)
            return out.hidden_states[1] if out.hidden_states is not None else out.last_hidden_state

    model = FirstLayerOrLast()
    x, u = randn(2, 5, 16), randn(2, 5, 16)
    for _ in range(2):
        _calls(model, x, u, "captured")
    bert.config.output_hidden_states = True
    y, t, said = _calls(model, x, u, "captured")
    y_e, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    torch.testing.assert_close(y, y_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)


class _TakesSettings(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, x, settings):
        return nn.functional.leaky_relu(self.lin(x), settings.slope) * settings.gains["out"] + settings.inner.shift


@pytest.mark.parametrize("change", ["field", "dict_item", "nested_field"])
def test_a_changed_field_of_an_argument_object_recaptures(change):
    """An object passed to the forward is told apart by identity; before, its fields were not re-checked (a slope
    changed from 0.1 to 0.5 between calls: JVP off by 0.56, silently)."""
    torch.manual_seed(0)
    model, settings = _TakesSettings().to(D), _Settings()
    x, u = randn(4, 6), randn(1, 4, 6)
    (xs,), s = jvpreg.clone.pack((x,), (u,))
    for _ in range(2):
        jvpreg.clone.call(model, (xs, settings), engine="captured")
    if change == "field":
        settings.slope = 0.5
    elif change == "dict_item":
        settings.gains["out"] = 0.5
    else:
        settings.inner.shift = 0.5
    y = jvpreg.clone.unpack(jvpreg.clone.call(model, (xs, settings), engine="captured"), s)
    y_e = jvpreg.clone.unpack(jvpreg.clone.call(model, (xs, settings), engine="eager"), s)
    for a, b in zip(y, y_e):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    (prog,) = capture.programs(model).values()
    assert settings in prog.keep  # alive: an equal id is this object
    assert {"_Settings.slope", "_Settings.gains", "_Settings.inner.shift"} <= {label for *_, label in prog.guards.attributes}


SLOPE, GAIN, CALLS = 0.1, 1.0, 0  # module globals the forwards below read (and one writes)


def _gained(h):
    return h * GAIN


class _SteeredByGlobals(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def _activation(self, h):
        return nn.functional.leaky_relu(h, SLOPE)

    def forward(self, x):
        return _gained(self._activation(self.lin(x)))


@pytest.mark.parametrize("name", ["SLOPE", "GAIN"])
def test_a_changed_module_global_that_the_forward_reads_recaptures(name, monkeypatch):
    """SLOPE is read by a method the forward calls (``self._activation``), GAIN by a function it calls; before,
    neither was re-checked (a replay kept the capturing call's value, silently)."""
    torch.manual_seed(0)
    model = _SteeredByGlobals().to(D)
    x, u = randn(4, 6), randn(4, 6)
    for _ in range(2):
        _calls(model, x, u, "captured")
    monkeypatch.setitem(globals(), name, 0.5)
    y, t, said = _calls(model, x, u, "captured")
    y_e, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    assert said == []
    torch.testing.assert_close(y, y_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)
    (prog,) = capture.programs(model).values()
    assert {f"{__name__}.SLOPE", f"{__name__}.GAIN"} <= {label for *_, label in prog.guards.attributes}


def test_a_forward_that_rebinds_a_module_global_runs_eagerly_and_rebinds_it_once_per_call(monkeypatch):
    class Counting(_SteeredByGlobals):
        def forward(self, x):
            global CALLS
            CALLS += 1
            return super().forward(x)

    monkeypatch.setitem(globals(), "CALLS", 0)
    model = Counting().to(D)
    said = []
    for _ in range(3):
        said += _calls(model, randn(4, 6), randn(4, 6), "captured")[2]
    assert CALLS == 3  # the trace's write was put back; each (eager) call wrote once
    assert said and f"module globals ({__name__}.CALLS)" in said[0]


class _Sealed:
    """Refuses subclasses, as some registries' base classes do: it cannot take a recording class."""

    def __init_subclass__(cls, **kwargs):
        raise ValueError("no subclasses")

    def __init__(self):
        self.slope = 0.1


@pytest.mark.parametrize("held", ["sealed", "enum"])
def test_a_held_object_that_cannot_take_a_recording_class_has_every_field_re_checked(held):
    import enum

    class Mode(enum.Enum):
        SOFT = 0.1
        HARD = 0.3

    class Steered(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 8)
            self.settings = _Sealed() if held == "sealed" else Mode.SOFT

        def forward(self, x):
            slope = self.settings.slope if held == "sealed" else self.settings.value
            return nn.functional.leaky_relu(self.lin(x), slope)

    model = Steered().to(D)
    x, u = randn(4, 6), randn(4, 6)
    for _ in range(2):
        assert _calls(model, x, u, "captured")[2] == []
    (prog,) = capture.programs(model).values()
    assert prog.gm is not None and type(model.settings) in (_Sealed, Mode)
    if held == "sealed":
        model.settings.slope = 0.3
    else:
        model.settings = Mode.HARD  # an enum member is compared by identity
    _, t, said = _calls(model, x, u, "captured")
    _, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    assert said == []
    torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)


class _SealedModule(nn.Module):
    def __init_subclass__(cls, **kwargs):
        raise ValueError("no subclasses")

    def __init__(self):
        super().__init__()
        self.lin, self.slope = nn.Linear(6, 8), 0.1

    def forward(self, x):
        return nn.functional.leaky_relu(self.lin(x), self.slope)


def test_a_module_that_cannot_take_a_recording_class_is_captured_with_every_field_re_checked():
    """Before: the trace raised the class's ValueError to the caller."""
    model = _SealedModule().to(D)
    x, u = randn(4, 6), randn(4, 6)
    for _ in range(2):
        assert _calls(model, x, u, "captured")[2] == []
    model.slope = 0.3
    _, t, said = _calls(model, x, u, "captured")
    _, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    assert said == [] and type(model) is _SealedModule
    torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)
    assert [p.gm is not None for p in capture.programs(model).values()] == [True]


@pytest.mark.parametrize("kind", ["hparams", "omegaconf", "missing_key"])
def test_values_that_an_objects_getattr_computes_are_re_checked(kind):
    """A Lightning ``self.hparams`` (a dict whose items are read as attributes) and an OmegaConf config give their
    values from ``__getattr__``, not from fields; before, a changed one replayed the old program (off by 0.79 and
    1.98, silently)."""
    from pytorch_lightning.utilities.parsing import AttributeDict

    import omegaconf

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 8)
            self.hparams = AttributeDict(temperature=1.0)
            self.cfg = omegaconf.OmegaConf.create({"head": {"scale": 1.0}}) if kind == "omegaconf" else None

        def forward(self, x):
            h = self.lin(x) * self.hparams.temperature * getattr(self.hparams, "extra", 1.0)
            return h * self.cfg.head.scale if self.cfg is not None else h

    model = Scaled().to(D)
    x, u = randn(4, 6), randn(4, 6)
    jvpreg.jvp(model, (x,), (u,), engine="eager")  # OmegaConf fills a cache on its first access
    for _ in range(2):
        assert _calls(model, x, u, "captured")[2] == []
    if kind == "hparams":
        model.hparams.temperature = 3.0
    elif kind == "omegaconf":
        model.cfg.head.scale = 2.0
    else:
        model.hparams.extra = 0.5  # absent at capture: its absence was recorded
    y, t, said = _calls(model, x, u, "captured")
    y_e, t_e = jvpreg.jvp(model, (x,), (u,), engine="eager")
    assert said == []
    torch.testing.assert_close(y, y_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t, t_e, rtol=1e-12, atol=1e-12)
    assert [p.gm is not None for p in capture.programs(model).values()] == [True]
