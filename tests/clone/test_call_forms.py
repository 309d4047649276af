"""Every call form of every op: arguments by keyword, mixed, or all by keyword, against ``torch.func.jvp``.

The forms are generated from torch's own signatures (:func:`jvpreg.clone.core.registry.overloads`: the ATen schemas
torch's argument parser binds keywords by), on OpInfo's samples, for each op's torch function and Tensor method;
a form torch refuses is not a case (:func:`op_sweep.keyword_cases`). Each case must be exact (float64,
values and gradients) or raise a clear ``UnsupportedOpError``, as in the positional sweep (test_opinfo_sweep.py).
"""
from __future__ import annotations

import expecttest  # noqa: F401  (torch.testing._internal needs it: a declared dependency, imported, not skipped)
import pytest
import torch

from jvpreg.clone.core import registry
import op_sweep as sweep

OPS = sweep.sweep_ops()

# the forms users hit first (the unpatchify of every DiT, MAE and ViT decoder) run in the quick test run
QUICK = {"reshape", "view", "permute", "expand", "flatten", "transpose", "sum", "mean", "nn.functional.conv2d",
         "nn.functional.layer_norm", "nn.functional.silu", "nn.functional.scaled_dot_product_attention", "clamp",
         "softmax", "to", "narrow", "split", "repeat", "cat", "nn.functional.pad"}


def _key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@pytest.mark.parametrize("op", [pytest.param(o, id=_key(o), marks=() if o.name in QUICK else pytest.mark.sweep)
                                for o in OPS])
def test_every_keyword_form_is_exact_or_a_clear_error(op):
    results = sweep.run_keyword_op(op, n_samples=4)
    bad = [f"{r.case.id} {r.case.variant}: {r.kind}: {r.detail}" for r in results if r.kind in ("mismatch", "crash")]
    assert not bad, "\n".join(bad[:10])


@pytest.mark.parametrize("call, form", [
    (lambda x: x.reshape(shape=(2, 12)), "x.reshape(shape=)"),
    (lambda x: x.view(size=(2, 12)), "x.view(size=)"),
    (lambda x: x.permute(dims=(2, 0, 1)), "x.permute(dims=)"),
    (lambda x: x[:, :1].expand(size=(2, 5, 4)), "x.expand(size=)"),
    (lambda x: torch.reshape(input=x, shape=(6, 4)), "torch.reshape(input=, shape=)"),
    (lambda x: x.sum(axis=1, keepdims=True), "numpy spellings: axis=, keepdims="),
    (lambda x: torch.nn.functional.silu(x.clone(), True), "F.silu(x, True): inplace by position"),
])
def test_the_forms_that_crashed_in_real_models(call, form):
    """The forms of diffusers' DiT and a MeanFlow DiT's unpatchify (before: ``TypeError: _reshape() got an
    unexpected keyword argument 'shape'``)."""
    import jvpreg

    x = torch.randn(2, 3, 4, dtype=torch.float64)
    u = torch.randn_like(x)
    y, t = jvpreg.jvp(call, (x,), (u,))
    y_ref, t_ref = torch.func.jvp(call, (x,), (u,))
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t, t_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_the_forms_cover_the_shape_ops_by_keyword():
    """The generated cases include the four keyword forms that crashed, by torch's own names (the generator does
    not silently produce nothing for them)."""
    by_name = {o.name: o for o in OPS}
    seen = set()
    for name in ("reshape", "view", "permute", "expand"):
        for case in sweep.keyword_cases(by_name[name], n_samples=4):
            seen.add((name, case.variant))
    assert {("reshape", "method.keywords"), ("reshape", "function.all_keywords"), ("view", "method.keywords"),
            ("permute", "method.keywords"), ("expand", "method.keywords")} <= seen


@pytest.mark.slow
def test_the_sweep_detects_a_binder_that_drops_keywords(monkeypatch):
    """Mutation check: with keywords passed on unbound (the engine before), the keyword forms crash the sweep."""
    from jvpreg.clone.eager import dispatch

    monkeypatch.setattr(dispatch, "bind_arguments", lambda func, args, kwargs: (args, kwargs))
    op = next(o for o in OPS if o.name == "reshape")
    kinds = {r.kind for r in sweep.run_keyword_op(op, n_samples=2)}
    assert "crash" in kinds


def test_binding_fills_defaults_and_keeps_keyword_only_parameters():
    F = torch.nn.functional
    args, kwargs = registry.bind_arguments(F.conv2d, ("x", "w"), {"padding": 1})
    assert args == ("x", "w", None, [1, 1], 1) and kwargs == {}
    args, kwargs = registry.bind_arguments(torch.add, ("x",), {"other": "y", "alpha": 2})
    assert args == ("x", "y") and kwargs == {"alpha": 2}
    args, kwargs = registry.bind_arguments(torch.Tensor.to, ("x", torch.float32), {"memory_format": "m"})
    assert args == ("x", torch.float32) and kwargs == {"memory_format": "m"}
    # a call torch refuses (a required argument skipped) is passed on as it was
    assert registry.bind_arguments(torch.narrow, ("x",), {"start": 0}) == (("x",), {"start": 0})
