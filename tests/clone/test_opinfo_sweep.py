"""Never silently wrong, on PyTorch's own op database (``tests/op_sweep.py`` has the protocol).

One test per OpInfo with a derivative (float64; reverse-mode references where torch has no forward-mode formula):
every case must be exact (with a rule or via the exact
fallback), values and the gradients of a functional of them, or raise a clear ``UnsupportedOpError``; a wrong
primal/tangent/gradient or any other exception fails.
``XFAIL`` lists known failures, each with its reason and the cases that fail (a predicate on the case: its sample,
the differentiated argument), in every sweep: a listed case that passes or fails otherwise fails the test (strict),
and so does any failure of a case not listed, so the list only shrinks; an entry whose cause this torch lacks
(``Expected.cause``: a derivative another version has) is checked as any other op. ``UNSPECIFIED`` names the samples
an op's result is unspecified on (colliding indices), left out; the op's other samples are checked.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, Tuple

import pytest
import torch

import expecttest  # noqa: E402,F401  (torch.testing._internal needs it: a dev dependency)

from conftest import sinh_rule_with_a_detached_slope  # noqa: E402
from jvpreg.clone import register_handler  # noqa: E402
import op_sweep as sweep
from jvpreg.clone.core.device_paths import accelerator_path  # noqa: E402
from jvpreg.clone.core.registry import HANDLERS  # noqa: E402

OPS = sweep.sweep_ops()

@dataclasses.dataclass(frozen=True)
class Expected:
    """Known failures of one OpInfo: exactly the cases ``fails(case)`` selects fail (a mismatch or a crash whose
    detail matches ``detail``), in every sweep (eager, captured, accelerator path). Strict: a selected case that
    passes, or fails otherwise, fails the test (remove or fix the entry); a case not selected is checked as any
    other. ``cause(op)``: whether this torch has the cause (where not, the op is checked as any other)."""

    reason: str
    fails: Callable[[sweep.Case], bool]
    detail: str
    cause: Callable[[Any], bool] = lambda op: True


def _has_pdist_double_backward(op) -> bool:
    """torch differentiates pdist's backward (2.15; 2.11 raises, which the sweep counts as a clear error)."""
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(torch.nn.functional.pdist(x, p=10.0).sum(), x, create_graph=True)
    try:
        torch.autograd.grad(g.sum(), x)
    except NotImplementedError:
        return False
    return True


# op name -> its known failures. Keep it short; every entry is a known engine limitation or bug, of named samples.
XFAIL: Dict[str, Expected] = {
    "nn.functional.binary_cross_entropy_with_logits": Expected(
        "gradient w.r.t. weight/pos_weight: torch's op has none (a plain backward raises the same error); the "
        "rule's primal is torch's op",
        lambda c: c.where in ("[2]['weight']", "[2]['pos_weight']"),
        r"backward: RuntimeError: .*not differentiable with respect to argument '(weight|pos_weight)'"),
    "nn.functional.embedding": Expected(
        "sparse=True: the fallback's JVP has no reverse mode for sparse gradients (with max_norm too it passes)",
        lambda c: bool(c.sample_input.kwargs.get("sparse", False)) and "max_norm" not in c.sample_input.kwargs,
        r"backward: RuntimeError: .*different layout"),
    "nn.functional.pdist": Expected(
        "p=10: torch's double backward of pdist gives NaN gradients, which the reverse-mode fallback inherits (NaN, "
        "as through torch's own double-backward JVP; never a finite wrong value)",
        lambda c: c.sample_input.kwargs.get("p") == 10.0,
        r"directional derivative nan.*reverse mode through torch\.func\.jvp nan",
        cause=_has_pdist_double_backward),
}


def _colliding_indices(sample) -> bool:
    """max_unpool2d's indices send two inputs to one output entry (overlapping pooling windows picked the same
    maximum): which one lands is unspecified (torch's docs), so its tangent there is too."""
    idx = sample.args[0]
    planes = idx.reshape(-1, idx.shape[-2] * idx.shape[-1])
    return any(row.unique().numel() < row.numel() for row in planes)


# op name -> (why, which samples): samples whose result the op leaves unspecified, not checked; the op's other
# samples are (max_unpool2d: 23 of its first 40 collide, 17 are checked)
UNSPECIFIED: Dict[str, Tuple[str, Callable[[Any], bool]]] = {
    "nn.functional.max_unpool2d": ("colliding indices: which value lands is unspecified", _colliding_indices),
}


def check_results(key: str, op, results: list, whole: bool, what=lambda r: f"{r.kind} {r.case.id}: {r.detail}"):
    """The sweep's verdict on one op's ``results``: no failure but the expected ones (:data:`XFAIL`), each of those
    failing as expected, and (``whole``: every sample of the sweep ran) at least one of them seen; xfail when one
    was seen. Samples of :data:`UNSPECIFIED` are left out."""
    exp = XFAIL.get(key)
    exp = exp if exp is not None and exp.cause(op) else None
    unspecified = UNSPECIFIED.get(key)
    if unspecified is not None:
        results = [r for r in results if r.case.sample_input is None or not unspecified[1](r.case.sample_input)]
        assert results, f"{key}: every sample was left out as unspecified"
    expected = [r for r in results if exp is not None and r.case.sample_input is not None and exp.fails(r.case)]
    ids = {id(r) for r in expected}
    bad = [r for r in _failures(results) if id(r) not in ids]
    assert not bad, "\n".join(what(r) for r in bad)
    if exp is None:
        return
    otherwise = [r for r in expected if r.kind not in ("mismatch", "crash") or not re.search(exp.detail, r.detail)]
    assert not otherwise, (f"{key}: expected failures ({exp.reason}) that pass now or fail otherwise: fix XFAIL\n"
                           + "\n".join(what(r) for r in otherwise))
    assert expected or not whole, f"{key}: no case of the sweep fails as XFAIL says ({exp.reason}): remove it"
    if expected:
        pytest.xfail(f"{len(expected)} of {len(results)} cases: {exp.reason}")


def _failures(results):
    return [r for r in results if r.kind in ("mismatch", "crash")]


# one op per rule family (QUICK): the cheapest six (QUICK_TIER) run in the quick tier; the others and the whole
# database in the sweep tier (--slow: CI, or --tier sweep)
QUICK = {"nn.functional.relu", "nn.functional.gelu", "tanh", "softmax", "log_softmax", "masked_fill", "where",
         "matmul", "nn.functional.conv2d", "nn.functional.layer_norm", "nn.functional.batch_norm",
         "nn.functional.max_pool2d", "nn.functional.scaled_dot_product_attention", "nn.functional.embedding",
         "amax", "logsumexp", "cumsum", "index_put", "scatter_add", "clamp", "mul", "div.no_rounding_mode",
         "cdist", "scatter_reduce.prod", "half", "nn.functional.linear_cross_entropy.chunked"}
QUICK_TIER = {"nn.functional.relu", "tanh", "softmax", "cumsum", "nn.functional.embedding", "half"}


def _key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@pytest.mark.parametrize("op", [pytest.param(o, id=_key(o), marks=() if _key(o) in QUICK_TIER else pytest.mark.sweep)
                                for o in OPS])
def test_opinfo_exact_or_clear_error(op):
    check_results(_key(op), op, sweep.run_op(op), whole=True)


# The captured engine (what the callbacks and jvpreg.jvp on modules replay) on the same cases: each op wrapped in a
# module and recorded into a program, whose passes and replay must stay exact. A forward it cannot capture (an op
# without a rule takes the fallback, which runs eagerly only) runs eagerly: exact, and counted (``Result.capture``),
# so that an op with a rule must be captured in at least one case: the test cannot pass by never capturing.
# The quick tier: tanh (QUICK_TIER_CAPTURED; the other rule families of QUICK take 2-25 s each), 20 samples
# each (the first are often 0-d; SDPA's first captured case is its 17th). The sweep tier (--slow: CI, or --tier sweep):
# the rule families of QUICK (the fallback-only ops there run eagerly) on all N_SAMPLES, every other op
# on every SLOW_EVERY-th of them (``sweep.strided``: the first, the last and evenly between, 11 of 40; all 40 of
# every op took 32 minutes on 2 cores, a third of CI's limit; the eager sweep takes all 40 of every op).
QUICK_CAPTURED = QUICK - {"cdist", "scatter_reduce.prod", "half", "nn.functional.linear_cross_entropy.chunked"}
QUICK_TIER_CAPTURED = {"tanh"}
QUICK_CAPTURED_SAMPLES = 20
SLOW_EVERY = 4


@pytest.mark.parametrize("op", [pytest.param(o, id=_key(o), marks=() if _key(o) in QUICK_TIER_CAPTURED else
                                             pytest.mark.sweep) for o in OPS])
def test_opinfo_captured_exact_or_clear_error(op, request):
    _check_captured(op, request, whole=QUICK_CAPTURED)


# The accelerator's path (``jvpreg.clone.core.device_paths.accelerator_path``: scales chosen by kernels, the non-finite
# fixes kept where an infinity can reach, the device's BatchNorm forms), taken on the CPU. The quick run: the batch
# norms' sweeps took 13-64 s each, so none: all in the sweep tier (tests/clone/test_accelerator_path.py takes the path
# in the quick tier), the rule families of QUICK and every norm, the batch norms (ACCELERATOR_QUICK, whose rules branch
# on the device) on all N_SAMPLES, the others on every SLOW_EVERY-th (all 40 of all took 10 minutes).
ACCELERATOR_QUICK = {"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
                     "nn.functional.batch_norm", "nn.functional.instance_norm"}
ACCELERATOR = QUICK_CAPTURED | {_key(o) for o in OPS if "norm" in _key(o)}


@pytest.mark.sweep
@pytest.mark.parametrize("op", [o for o in OPS if _key(o) in ACCELERATOR], ids=_key)
def test_opinfo_accelerator_path_exact_or_clear_error(op, request):
    with accelerator_path():
        _check_captured(op, request, whole=ACCELERATOR_QUICK)


#: ops whose programs the capture refuses (they place data by storage offset, and a replayed program's gradient
#: differed from the forward's: jvpreg.clone.program.capture._STRIDED); their calls run in eager clone mode with the reason
STORAGE_OFFSET_OPS = {"as_strided", "as_strided_scatter"}


def _check_captured(op, request, whole):
    """The captured sweep of one op: QUICK_CAPTURED_SAMPLES; in the sweep tier, all N_SAMPLES for the ops
    in ``whole`` and every SLOW_EVERY-th for the others."""
    key = _key(op)
    n, every = QUICK_CAPTURED_SAMPLES, 1
    if request.config.getoption("--slow") or "sweep" in request.config.getoption("--tier"):
        n, every = sweep.N_SAMPLES, 1 if key in whole else SLOW_EVERY
    results = sweep.run_op(op, n_samples=n, engine="captured", every=every)
    if op.name in STORAGE_OFFSET_OPS:  # refused by the capture, by its reason: the eager runs are swept
        assert all(r.capture.startswith("eager") for r in results if r.kind in ("rule", "fallback"))
        assert any("places data by storage offset" in r.capture for r in results), sorted({r.capture for r in results})
    elif any(r.kind == "rule" for r in results):
        assert any(r.capture == "captured" for r in results if r.kind in ("rule", "fallback")), \
            f"{key}: no case was captured: {sorted({r.capture for r in results})}"
    check_results(key, op, results, whole=n == sweep.N_SAMPLES and every == 1,
                  what=lambda r: f"{r.kind} {r.case.id} ({r.capture}): {r.detail}")


# Value-shaped ops: a captured program holds the shapes its ops made, so an op whose output shape follows its
# inputs' values (``nonzero``, ``x[mask]``, ``unique``) must be guarded (``jvpreg.clone.program.value_shapes.dynamic_shapes``). Every
# op of the database (int64 or bool where it has no float64: index and mask ops are recorded too), each sample recorded
# on its values and on others of the same shapes (``sweep.value_shaped``). These found value-shaped ops on torch 2.15
# (12 OpInfos, 13 aten ops) and run on all N_SAMPLES: repeat_interleave in the quick tier (the others take 2-16 s
# each), the rest in the sweep tier, with every other OpInfo on every SLOW_EVERY-th sample (all 40 of all took 16
# minutes on 2 cores).
VALUE_SHAPED = {"masked_select", "tensor_split", "__getitem__", "unique", "unique_consecutive", "bincount", "nonzero",
                "nn.functional.one_hot", "argwhere", "repeat_interleave", "linalg.lstsq", "linalg.lstsq.grad_oriented"}


@pytest.mark.parametrize("op", [pytest.param(o, id=_key(o), marks=() if _key(o) == "repeat_interleave" else
                                             pytest.mark.sweep) for o in sweep.value_shape_ops()])
def test_opinfo_value_shaped_ops_are_guarded(op):
    found = sweep.value_shaped(op, every=1 if _key(op) in VALUE_SHAPED else SLOW_EVERY)
    unguarded = sorted({(name, sample) for name, sample, guarded in found if not guarded})
    assert not unguarded, f"{_key(op)}: output shapes follow values, no shape guard: {unguarded}"
    if _key(op) in VALUE_SHAPED:  # the sweep must see them, or it could not fail
        assert found, f"{_key(op)}: no value-shaped op found any more"


@pytest.mark.slow
def test_value_shape_sweep_detects_an_unguarded_op(monkeypatch):
    """With the capture's shape guards taken away, ``nonzero`` is reported unguarded."""
    from jvpreg.clone.program import value_shapes

    op = next(o for o in sweep.value_shape_ops() if o.name == "nonzero")
    monkeypatch.setattr(value_shapes, "dynamic_shapes", lambda graph: [])
    assert any(name == "aten.nonzero.default" and not guarded for name, _, guarded in sweep.value_shaped(op))


@pytest.mark.slow
def test_strided_cases_keep_the_first_the_last_and_their_values():
    """``cases(op, n, every)``: samples 0, every, 2 every, ... and the last, the same cases as the whole sweep's."""
    op = next(o for o in OPS if o.name == "matmul")
    whole = {(c.sample, c.operand, c.variant): c.primal for c in sweep.cases(op)}
    strided = {(c.sample, c.operand, c.variant): c.primal for c in sweep.cases(op, every=SLOW_EVERY)}
    last = max(s for s, _, _ in whole)
    assert last > 2 * SLOW_EVERY
    assert {s for s, _, _ in strided} == set(range(0, last + 1, SLOW_EVERY)) | {last}
    assert all(torch.equal(whole[k], v) for k, v in strided.items())


def test_sweep_detects_a_wrong_rule_and_a_crash():
    """The classifier itself: a deliberately wrong rule is a mismatch, a broken one a crash."""
    op = next(o for o in OPS if o.name == "sinh")
    case = next(sweep.cases(op, 1))
    old = HANDLERS.pop(torch.sinh, None)
    try:
        register_handler(torch.sinh)(lambda func, args, kwargs: type(args[0]).cosh(args[0]))
        assert sweep.run_case(case).kind == "mismatch"
        register_handler(torch.sinh)(lambda func, args, kwargs: 1 / 0)
        assert sweep.run_case(case).kind == "crash"
    finally:
        HANDLERS.pop(torch.sinh, None)
        if old is not None:
            HANDLERS[torch.sinh] = old
    assert sweep.run_case(case).kind in ("rule", "fallback")


def test_sweep_detects_a_wrong_gradient():
    """The gradient check: a rule exact in value whose slope is detached from the primal (its penalty gradients
    lose the second-order term) is a mismatch."""
    op = next(o for o in OPS if o.name == "sinh")
    case = next(c for c in sweep.cases(op) if c.primal.numel() > 1)
    old = HANDLERS.pop(torch.sinh, None)
    try:
        register_handler(torch.sinh)(sinh_rule_with_a_detached_slope)
        result = sweep.run_case(case)
        assert result.kind == "mismatch" and "gradient" in result.detail, result
    finally:
        HANDLERS.pop(torch.sinh, None)
        if old is not None:
            HANDLERS[torch.sinh] = old
    assert sweep.run_case(case).kind in ("rule", "fallback")


# The compiled engine (the captured program under torch.compile; some rules take another form there:
# jvpreg.clone.core.tensor.compiling) on a few samples of the rule families that models use: seconds per case, so slow.
# Not avg_pool2d: torch.compile's lowering of its backward rejects a 1-element padding, plain torch.compile too.
COMPILED = {"nn.functional.relu", "nn.functional.leaky_relu", "nn.functional.hardtanh", "nn.functional.gelu",
            "nn.functional.silu", "softmax", "log_softmax", "masked_fill", "nn.functional.layer_norm",
            "nn.functional.group_norm", "nn.functional.batch_norm", "nn.functional.max_pool2d", "logsumexp", "amax",
            "nn.functional.conv2d", "matmul"}
COMPILED_SAMPLES = 4


@pytest.mark.sweep
@pytest.mark.parametrize("op", [o for o in OPS if _key(o) in COMPILED], ids=_key)
def test_opinfo_compiled_exact(op):
    results = sweep.run_op(op, n_samples=COMPILED_SAMPLES, engine="compiled")
    bad = _failures(results)
    assert not bad, "\n".join(f"{r.kind} {r.case.id} ({r.capture}): {r.detail}" for r in bad)
    assert any(r.capture == "captured" for r in results if r.kind == "rule"), \
        f"{_key(op)}: no case was compiled: {sorted({r.capture for r in results})}"


def _scaled_by_its_largest_entry(x):
    """Python reads a value (``.item()``): a program holds it for one value, and its guard re-checks it."""
    return x * x.abs().max().item()


@pytest.mark.slow
def test_captured_sweep_replays_on_other_values_and_detects_an_unguarded_read(monkeypatch):
    """The captured sweep replays each program on other values of the input: a value read by Python that the
    program replayed without its guard (here: every guard taken as holding) is a mismatch there."""
    from jvpreg.clone.program.guards import Guards

    x = torch.randn(3, 4, dtype=torch.float64)
    case = sweep.Case("scaled", "", 0, 0, _scaled_by_its_largest_entry, x)
    assert sweep.run_case(case, engine="captured").kind == "rule"
    monkeypatch.setattr(Guards, "check", lambda self, root, inputs: None)
    result = sweep.run_case(case, engine="captured")
    assert result.kind == "mismatch" and "replay on other values" in result.detail, result


@pytest.mark.sweep
@pytest.mark.parametrize("op", OPS, ids=_key)
def test_float32_jvps_are_as_accurate_as_torch_func(op):
    """Every op of the database in float32, against float64 references: our tangent is within 10x torch.func's own
    float32 error plus 1e-6 max|f(x)| (``sweep.float32_errors``). The exact fallback once differentiated along the
    clone block's ``s u`` (s ~ 2^20 rms(x) / rms(u) then), where matrix_exp's forward-mode formula is 23% off in float32."""
    unspecified = UNSPECIFIED.get(_key(op))
    bad = sweep.float32_errors(op, skip=None if unspecified is None else unspecified[1])
    assert not bad, "\n".join(f"{c}: error {o:.3g}, torch.func's {t:.3g}, allowed {a:.3g}" for c, o, t, a in bad)


@pytest.mark.slow
def test_float32_check_detects_a_fallback_along_the_scaled_tangent(monkeypatch):
    """The float32 check flags matrix_exp when the fallback differentiates along ``s u`` (its old behaviour)."""
    from jvpreg.clone.eager import dispatch

    op = next(o for o in sweep.sweep_ops() if o.name == "matrix_exp")
    assert not sweep.float32_errors(op, n_samples=2)
    monkeypatch.setattr(dispatch, "_unit_scale", lambda primals, tangents: torch.ones((), dtype=torch.float64))
    assert sweep.float32_errors(op, n_samples=2)


def test_expected_failures_are_per_case_and_strict():
    """``check_results`` on embedding's real cases with made-up verdicts: its sparse=True case failing as listed is
    an xfail; a failure of any other embedding case fails the test (the list hides no new failure of a listed op);
    the listed case passing, or failing otherwise, fails it too; and a whole sweep where no case fails as listed
    says to remove the entry."""
    op = next(o for o in OPS if _key(o) == "nn.functional.embedding")
    cases = list(sweep.cases(op))
    listed = [c for c in cases if XFAIL["nn.functional.embedding"].fails(c)]
    assert len(listed) == 1 and 1 < len(cases), [c.id for c in listed]
    layout = "backward: RuntimeError: to(options) doesn't support converting to a different layout"

    def verdicts(kind_of):
        return [sweep.Result(c, *kind_of(c)) for c in cases]

    with pytest.raises(pytest.xfail.Exception, match="1 of 10 cases: sparse=True"):
        check_results(_key(op), op, verdicts(lambda c: ("crash", layout) if c in listed else ("rule",)), whole=True)
    with pytest.raises(AssertionError, match=r"crash nn\.functional\.embedding\[s0x0\]: new"):
        check_results(_key(op), op, verdicts(lambda c: ("crash", layout) if c in listed else
                                             ("crash", "new") if c.sample == 0 else ("rule",)), whole=True)
    for now in (("rule",), ("mismatch", "primal: off by 1")):
        with pytest.raises(AssertionError, match="expected failures .* that pass now or fail otherwise"):
            check_results(_key(op), op, verdicts(lambda c: now if c in listed else ("rule",)), whole=True)
    strided = [c for c in cases if c not in listed]
    check_results(_key(op), op, [sweep.Result(c, "rule") for c in strided], whole=False)  # a part: not seen, fine
    with pytest.raises(AssertionError, match="no case of the sweep fails as XFAIL says"):
        check_results(_key(op), op, [sweep.Result(c, "rule") for c in strided], whole=True)


def test_max_unpool2d_leaves_out_only_its_colliding_samples():
    """max_unpool2d's samples with colliding indices are left out (unspecified), its others checked: a crash on one
    of those fails the test."""
    op = next(o for o in OPS if _key(o) == "nn.functional.max_unpool2d")
    cases = list(sweep.cases(op))
    colliding = {c.sample for c in cases if _colliding_indices(c.sample_input)}
    assert 0 < len(colliding) < len({c.sample for c in cases})
    check_results(_key(op), op, [sweep.Result(c, "crash" if c.sample in colliding else "rule") for c in cases],
                  whole=True)
    with pytest.raises(AssertionError, match="crash"):
        check_results(_key(op), op, [sweep.Result(c, "crash" if c.sample not in colliding else "rule")
                                     for c in cases], whole=True)
