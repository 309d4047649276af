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
XFAIL: dict = {}


def _failures(results):
    return [r for r in results if r.kind in ("mismatch", "crash")]


# one op per rule family runs in the quick test run; the whole database with --slow (CI)
QUICK = {"nn.functional.relu", "nn.functional.gelu", "tanh", "softmax", "log_softmax", "masked_fill", "where",
         "matmul", "nn.functional.conv2d", "nn.functional.layer_norm", "nn.functional.batch_norm",
         "nn.functional.max_pool2d", "nn.functional.scaled_dot_product_attention", "nn.functional.embedding",
         "amax", "logsumexp", "cumsum", "index_put", "scatter_add", "clamp", "mul", "div.no_rounding_mode"}


def _key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@pytest.mark.parametrize("op", [pytest.param(o, id=_key(o), marks=() if _key(o) in QUICK else pytest.mark.slow)
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
