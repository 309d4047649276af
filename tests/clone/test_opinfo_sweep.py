"""Never silently wrong, on PyTorch's own op database (``jvpreg/clone/sweep.py`` has the protocol).

One test per OpInfo (float64, forward AD): every case must be exact (with a rule or via the exact
fallback) or raise a clear ``UnsupportedOpError``; a wrong primal/tangent or any other exception fails.
``XFAIL`` lists known failures, each with its reason; an entry that starts passing fails the test
(strict), so the list only shrinks.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("expecttest")  # torch.testing._internal needs it

from jvpreg.clone import register_handler, sweep  # noqa: E402
from jvpreg.clone.registry import HANDLERS  # noqa: E402

OPS = sweep.sweep_ops()

# op name -> reason. Keep it short; every entry is a known engine limitation or bug.
XFAIL: dict = {
    'addbmm': 'crash: in-place addbmm_ with a varying batch product (bilinear.py) mis-shapes the sum over the batch',
    'clamp': 'crash: tensor bounds of another rank than the input are not broadcast (cpa.py)',
    'cumsum': 'crash: 0-dim input, dim 0 (structural.py reads dims of a logical scalar)',
    'div.trunc_rounding': 'silently wrong: the rounding_mode keyword is ignored on a constant divisor (tangent u/y, not 0)',
    'div.floor_rounding': 'silently wrong: the rounding_mode keyword is ignored on a constant divisor (tangent u/y, not 0)',
    'expand_as': 'crash: a batch tensor used only for its shape (other is the clone)',
    'reshape_as': 'crash: a batch tensor used only for its shape (other is the clone)',
    'view_as': 'crash: a batch tensor used only for its shape (other is the clone)',
    'masked_fill': 'crash: a varying 0-dim fill value',
    'max.reduction_with_dim': 'crash: 0-dim input',
    'max.reduction_no_dim': 'crash: 0-dim input',
    'min.reduction_with_dim': 'crash: 0-dim input',
    'min.reduction_no_dim': 'crash: 0-dim input',
    'amax': 'crash: 0-dim input / empty dim list',
    'amin': 'crash: 0-dim input / empty dim list',
    'masked.amax': 'crash: 0-dim input',
    'masked.amin': 'crash: 0-dim input',
    'mean': 'crash: 0-dim input with dim=0',
    'sum': 'crash: 0-dim input with dim=0',
    'nansum': 'crash: 0-dim input with dim=0',
    'masked.sum': 'crash: 0-dim input with dim=0',
    'masked.mean': 'crash: 0-dim input with dim=0',
    'as_strided': 'crash: in-place view op as_strided_ goes through the out-of-place op and copy_',
    'as_strided.partial_views': 'crash: in-place view op as_strided_',
    'squeeze': 'crash: in-place view op squeeze_',
    'squeeze.multiple': 'crash: in-place view op squeeze_',
    'unsqueeze': 'crash: in-place view op unsqueeze_',
    'transpose': 'crash: in-place view op transpose_',
    't': 'crash: in-place view op t_',
    'nn.functional.batch_norm': 'crash: empty / degenerate input',
    'column_stack': 'crash: vmap has no batching rule for column_stack',
    'index_fill': 'silently wrong: a varying 0-dim fill value lands in the primal block',
    'H': 'silently wrong: the .H getter drops the tangent',
}


def _failures(results):
    return [r for r in results if r.kind in ("mismatch", "crash")]


@pytest.mark.parametrize("op", OPS, ids=[f"{o.name}.{o.variant_test_name}" if o.variant_test_name else o.name
                                         for o in OPS])
def test_opinfo_exact_or_clear_error(op):
    key = f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
    bad = _failures(sweep.run_op(op))
    if key in XFAIL:
        assert bad, f"{key} passes now: remove it from XFAIL ({XFAIL[key]})"
        pytest.xfail(XFAIL[key])
    assert not bad, "\n".join(f"{r.kind} {r.case.id}: {r.detail}" for r in bad)


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
