"""Never silently wrong, on PyTorch's own op database (``jvpreg/clone/sweep.py`` has the protocol).

One test per OpInfo with a derivative (float64; reverse-mode references where torch has no forward-mode formula):
every case must be exact (with a rule or via the exact
fallback), values and the gradients of a functional of them, or raise a clear ``UnsupportedOpError``; a wrong
primal/tangent/gradient or any other exception fails.
``XFAIL`` lists known failures, each with its reason; an entry that starts passing fails the test
(strict), so the list only shrinks; only a failure that is itself nondeterministic (reason ``"flaky: ..."``)
may pass, and an op whose cause this torch lacks (``XFAIL_CAUSE``: a sample or a derivative another version has).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("expecttest")  # torch.testing._internal needs it

from conftest import sinh_rule_with_a_detached_slope  # noqa: E402
from jvpreg.clone import register_handler, sweep  # noqa: E402
from jvpreg.clone.device_paths import accelerator_path  # noqa: E402
from jvpreg.clone.registry import HANDLERS  # noqa: E402

OPS = sweep.sweep_ops()

# op name -> reason. Keep it short; every entry is a known engine limitation or bug.
XFAIL: dict = {
    # found when the sweep took every sample (not the first 4) and checked gradients; not fixed yet
    "nn.functional.max_unpool2d": "flaky: colliding indices; which value lands is unspecified, and engine and torch "
                                  "differ in some runs only",
    "nn.functional.binary_cross_entropy_with_logits": "gradient w.r.t. weight/pos_weight: torch's op has none (a "
                                                      "plain backward raises the same error); the rule's primal is "
                                                      "torch's op",
    "nn.functional.embedding": "sparse=True: the fallback's JVP has no reverse mode for sparse gradients",
    "nn.functional.pdist": "p=10: torch's double backward of pdist gives NaN gradients, which the reverse-mode "
                           "fallback inherits (NaN, as through torch's own double-backward JVP; never a finite "
                           "wrong value)",
}


def _has_pdist_double_backward(op) -> bool:
    """torch differentiates pdist's backward (2.15; 2.11 raises, which the sweep counts as a clear error)."""
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(torch.nn.functional.pdist(x, p=10.0).sum(), x, create_graph=True)
    try:
        torch.autograd.grad(g.sum(), x)
    except NotImplementedError:
        return False
    return True


# op name -> whether this torch has the cause of the XFAIL entry: where it has not, the op may pass
XFAIL_CAUSE = {"nn.functional.pdist": _has_pdist_double_backward}


def _failures(results):
    return [r for r in results if r.kind in ("mismatch", "crash")]


# one op per rule family runs in the quick test run; the whole database with --slow (CI)
QUICK = {"nn.functional.relu", "nn.functional.gelu", "tanh", "softmax", "log_softmax", "masked_fill", "where",
         "matmul", "nn.functional.conv2d", "nn.functional.layer_norm", "nn.functional.batch_norm",
         "nn.functional.max_pool2d", "nn.functional.scaled_dot_product_attention", "nn.functional.embedding",
         "amax", "logsumexp", "cumsum", "index_put", "scatter_add", "clamp", "mul", "div.no_rounding_mode",
         "cdist", "scatter_reduce.prod", "half", "nn.functional.linear_cross_entropy.chunked"}


def _key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@pytest.mark.parametrize("op", [pytest.param(o, id=_key(o), marks=() if _key(o) in QUICK else pytest.mark.slow)
                                for o in OPS])
def test_opinfo_exact_or_clear_error(op):
    key = f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
    bad = _failures(sweep.run_op(op))
    if key in XFAIL and XFAIL_CAUSE.get(key, lambda _: True)(op):
        # strict, except where the failure itself is nondeterministic ("flaky: ...")
        assert bad or XFAIL[key].startswith("flaky:"), f"{key} passes now: remove it from XFAIL ({XFAIL[key]})"
        pytest.xfail(XFAIL[key])
    assert not bad, "\n".join(f"{r.kind} {r.case.id}: {r.detail}" for r in bad)


# The captured engine (what the callbacks and jvpreg.jvp on modules replay) on the same cases: each op wrapped in a
# module and recorded into a program, whose passes and replay must stay exact. A forward it cannot capture (an op
# without a rule takes the fallback, which runs eagerly only) runs eagerly: exact, and counted (``Result.capture``),
# so that an op with a rule must be captured in at least one case: the test cannot pass by never capturing.
# The quick run: the rule families of QUICK (the fallback-only ops there run eagerly), 20 samples each (the
# first are often 0-d; SDPA's first captured case is its 17th). With --slow: those on all N_SAMPLES, every other op
# on every SLOW_EVERY-th of them (``sweep.strided``: the first, the last and evenly between, 11 of 40; all 40 of
# every op took 32 minutes on 2 cores, a third of CI's limit; the eager sweep takes all 40 of every op).
QUICK_CAPTURED = QUICK - {"cdist", "scatter_reduce.prod", "half", "nn.functional.linear_cross_entropy.chunked"}
QUICK_CAPTURED_SAMPLES = 20
SLOW_EVERY = 4


@pytest.mark.parametrize("op", [pytest.param(o, id=_key(o), marks=() if _key(o) in QUICK_CAPTURED else
                                             pytest.mark.slow) for o in OPS])
def test_opinfo_captured_exact_or_clear_error(op, request):
    _check_captured(op, request, whole=QUICK_CAPTURED)


# The accelerator's path (``jvpreg.clone.device_paths.accelerator_path``: scales chosen by kernels, the non-finite
# fixes kept where an infinity can reach, the device's BatchNorm forms), taken on the CPU. The quick run: the batch
# norms, whose rules branch on the device; with --slow, the rule families of QUICK and every norm, the batch norms
# on all N_SAMPLES, the others on every SLOW_EVERY-th (all 40 of all took 10 minutes).
ACCELERATOR_QUICK = {"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
                     "nn.functional.batch_norm", "nn.functional.instance_norm"}
ACCELERATOR = QUICK_CAPTURED | {_key(o) for o in OPS if "norm" in _key(o)}


@pytest.mark.parametrize("op", [pytest.param(o, id=_key(o), marks=() if _key(o) in ACCELERATOR_QUICK else
                                             pytest.mark.slow) for o in OPS if _key(o) in ACCELERATOR])
def test_opinfo_accelerator_path_exact_or_clear_error(op, request):
    with accelerator_path():
        _check_captured(op, request, whole=ACCELERATOR_QUICK)


def _check_captured(op, request, whole):
    """The captured sweep of one op: the quick run's QUICK_CAPTURED_SAMPLES; with --slow, all N_SAMPLES for the ops
    in ``whole`` and every SLOW_EVERY-th for the others."""
    key = _key(op)
    n, every = QUICK_CAPTURED_SAMPLES, 1
    if request.config.getoption("--slow"):
        n, every = sweep.N_SAMPLES, 1 if key in whole else SLOW_EVERY
    results = sweep.run_op(op, n_samples=n, engine="captured", every=every)
    bad = _failures(results)
    if key in XFAIL and XFAIL_CAUSE.get(key, lambda _: True)(op):
        assert bad or XFAIL[key].startswith("flaky:") or n < sweep.N_SAMPLES or every > 1, \
            f"{key} passes now: remove it from XFAIL ({XFAIL[key]})"
        pytest.xfail(XFAIL[key])
    assert not bad, "\n".join(f"{r.kind} {r.case.id} ({r.capture}): {r.detail}" for r in bad)
    if any(r.kind == "rule" for r in results):
        assert any(r.capture == "captured" for r in results if r.kind in ("rule", "fallback")), \
            f"{key}: no case was captured: {sorted({r.capture for r in results})}"


# Value-shaped ops: a captured program holds the shapes its ops made, so an op whose output shape follows its
# inputs' values (``nonzero``, ``x[mask]``, ``unique``) must be guarded (``jvpreg.clone.guards.dynamic_shapes``). Every
# op of the database (int64 or bool where it has no float64: index and mask ops are recorded too), each sample recorded
# on its values and on others of the same shapes (``sweep.value_shaped``). These found value-shaped ops on torch 2.15
# (12 OpInfos, 13 aten ops) and run in the quick run, on all N_SAMPLES; with --slow, every other OpInfo on every
# SLOW_EVERY-th sample (all 40 of all took 16 minutes on 2 cores).
VALUE_SHAPED = {"masked_select", "tensor_split", "__getitem__", "unique", "unique_consecutive", "bincount", "nonzero",
                "nn.functional.one_hot", "argwhere", "repeat_interleave", "linalg.lstsq", "linalg.lstsq.grad_oriented"}


@pytest.mark.parametrize("op", [pytest.param(o, id=_key(o), marks=() if _key(o) in VALUE_SHAPED else pytest.mark.slow)
                                for o in sweep.value_shape_ops()])
def test_opinfo_value_shaped_ops_are_guarded(op):
    found = sweep.value_shaped(op, every=1 if _key(op) in VALUE_SHAPED else SLOW_EVERY)
    unguarded = sorted({(name, sample) for name, sample, guarded in found if not guarded})
    assert not unguarded, f"{_key(op)}: output shapes follow values, no shape guard: {unguarded}"
    if _key(op) in VALUE_SHAPED:  # the sweep must see them, or it could not fail
        assert found, f"{_key(op)}: no value-shaped op found any more"


def test_value_shape_sweep_detects_an_unguarded_op(monkeypatch):
    """With the capture's shape guards taken away, ``nonzero`` is reported unguarded."""
    from jvpreg.clone import guards

    op = next(o for o in sweep.value_shape_ops() if o.name == "nonzero")
    monkeypatch.setattr(guards, "dynamic_shapes", lambda graph: [])
    assert any(name == "aten.nonzero.default" and not guarded for name, _, guarded in sweep.value_shaped(op))


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
# jvpreg.clone.tensor.compiling) on a few samples of the rule families that models use: seconds per case, so slow.
# Not avg_pool2d: torch.compile's lowering of its backward rejects a 1-element padding, plain torch.compile too.
COMPILED = {"nn.functional.relu", "nn.functional.leaky_relu", "nn.functional.hardtanh", "nn.functional.gelu",
            "nn.functional.silu", "softmax", "log_softmax", "masked_fill", "nn.functional.layer_norm",
            "nn.functional.group_norm", "nn.functional.batch_norm", "nn.functional.max_pool2d", "logsumexp", "amax",
            "nn.functional.conv2d", "matmul"}
COMPILED_SAMPLES = 4


@pytest.mark.slow
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


def test_captured_sweep_replays_on_other_values_and_detects_an_unguarded_read(monkeypatch):
    """The captured sweep replays each program on other values of the input: a value read by Python that the
    program replayed without its guard (here: every guard taken as holding) is a mismatch there."""
    from jvpreg.clone import capture

    x = torch.randn(3, 4, dtype=torch.float64)
    case = sweep.Case("scaled", "", 0, 0, _scaled_by_its_largest_entry, x)
    assert sweep.run_case(case, engine="captured").kind == "rule"
    monkeypatch.setattr(capture, "_matching", lambda base, inputs: (base, None))
    result = sweep.run_case(case, engine="captured")
    assert result.kind == "mismatch" and "replay on other values" in result.detail, result


# float32: max_unpool2d fails for the reason it is in XFAIL (colliding indices, nondeterministic)
F32_XFAIL = {"nn.functional.max_unpool2d"}


@pytest.mark.slow
@pytest.mark.parametrize("op", [o for o in OPS if o.name not in F32_XFAIL], ids=_key)
def test_float32_jvps_are_as_accurate_as_torch_func(op):
    """Every op of the database in float32, against float64 references: our tangent is within 10x torch.func's own
    float32 error plus 1e-6 max|f(x)| (``sweep.float32_errors``). The exact fallback once differentiated along the
    clone block's ``s u`` (s ~ 2^20 rms(x) / rms(u) then), where matrix_exp's forward-mode formula is 23% off in float32."""
    bad = sweep.float32_errors(op)
    assert not bad, "\n".join(f"{c}: error {o:.3g}, torch.func's {t:.3g}, allowed {a:.3g}" for c, o, t, a in bad)


def test_float32_check_detects_a_fallback_along_the_scaled_tangent(monkeypatch):
    """The float32 check flags matrix_exp when the fallback differentiates along ``s u`` (its old behaviour)."""
    from jvpreg.clone import dispatch

    op = next(o for o in sweep.sweep_ops() if o.name == "matrix_exp")
    assert not sweep.float32_errors(op, n_samples=2)
    monkeypatch.setattr(dispatch, "_unit_scale", lambda primals, tangents: torch.ones((), dtype=torch.float64))
    assert sweep.float32_errors(op, n_samples=2)
