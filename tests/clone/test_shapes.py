"""User code that reads shapes, builds constants and indexes: the clone batch must look like the primal.

A clone reports the primal's logical shape (``x.shape``, ``len(x)``, ``x.size(0)``), so code that
builds shapes, masks or constants from its input must behave as it does on the primal alone, and
tensors that are not part of the batch (parameters, constants) must never be mistaken for it,
whatever their shape. Each setting runs under ``fallback_mode("error")`` (``"fallback": True``
allows the exact fallback for ops with no rule, e.g. ``cumprod``) and is compared with
``torch.func.jvp`` in float64 at 1e-10.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jvpreg
from conftest import assert_tree_close
from jvpreg.clone import fallback_mode

D = torch.float64
RTOL = 1e-10
B = 3


def run_setting(s: dict) -> None:
    torch.manual_seed(s.get("seed", 0))
    f = s["module"]().to(D) if "module" in s else s["func"]
    x = torch.randn(s.get("input_shape", (B, 4)), dtype=D)
    u = torch.randn_like(x)
    mode = "jvp" if s.get("fallback") else "error"
    with fallback_mode(mode):
        y, t = jvpreg.jvp(f, (x,), (u,))
    y_ref, t_ref = torch.func.jvp(f, (x,), (u,))
    assert_tree_close(y, y_ref, what="output")
    assert_tree_close(t, t_ref, what="tangent")


def cases(settings: list) -> pytest.MarkDecorator:
    ids = [s["id"] for s in settings]
    assert len(set(ids)) == len(ids), "duplicate setting ids"
    return pytest.mark.parametrize("setting", [
        pytest.param(s, id=s["id"], marks=pytest.mark.xfail(reason="engine bug: " + s["xfail"], strict=True))
        if "xfail" in s else pytest.param(s, id=s["id"])
        for s in settings
    ])


def const(*shape, start=-1.0, end=1.0):
    """A deterministic constant (not part of the batch)."""
    n = 1
    for d in shape:
        n *= d
    return torch.linspace(start, end, n, dtype=D).reshape(shape)


# ----------------------------------------------------------------------------- shapes read from the input


class FlattenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(x.view(x.size(0), -1)).relu()


def checks_shapes(x):
    assert len(x) == B and x.shape == (B, 4) and x.shape[0] == B and x.size(-1) == 4
    assert x.dim() == 2 and x.ndim == 2 and x.numel() == 4 * B and tuple(x.size()) == (B, 4)
    assert x.dtype == D and x.device.type == "cpu" and x.is_floating_point()
    return x.tanh() * len(x) + x.shape[1]


class DoubledBatchWeight(nn.Module):
    """A parameter of shape (2B, F): it is a weight, not a clone batch, whatever its shape."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(2 * B, 4))

    def forward(self, x):
        stacked = torch.cat([x, x.sin()]) * self.W  # (2B, F) batch tensor times a (2B, F) weight
        return stacked, x @ self.W.T, self.W.sum(0) * x, self.W[: x.shape[0]] + x


def buffer_from_zeros_like(x):
    buf = torch.zeros_like(x)
    buf[:, 0] = x[:, 1].tanh()
    buf[1] = x[0] * 2
    buf[:, 2:] += x[:, :2]
    return buf


def buffer_new_zeros_masked(x):
    buf = x.new_zeros(B, 4)
    mask = x > 0
    buf[mask] = x[mask].exp()
    return buf


def inplace_on_slices(x):
    h = x.clone()
    h[:, 0] *= 2
    h += 1
    h[:, 1:3].mul_(x[:, :2].sin())
    return h


SHAPE_SETTINGS = [
    {"id": "view-size0-linear", "module": FlattenLinear, "input_shape": (B, 2, 2, 2)},
    {"id": "shape-queries", "func": checks_shapes},
    {"id": "zeros-batch-dim-plus-h", "func": lambda x: torch.zeros(x.shape[0], 4, dtype=x.dtype) + x.tanh()},
    {"id": "ones_like-full_like", "func": lambda x: torch.ones_like(x) * 2 + torch.full_like(x, 3.0) * x},
    {"id": "arange-from-shape", "func": lambda x: torch.arange(x.shape[1], dtype=x.dtype) * x / x.shape[0]},
    {"id": "where-leaky", "func": lambda x: torch.where(x > 0, x, 0.1 * x)},
    {"id": "where-scalar", "func": lambda x: torch.where(x > 0, x, 0.0)},
    {"id": "masked_fill", "func": lambda x: x.masked_fill(x < 0, 0.5) * x},
    {"id": "bool-mask-index", "func": lambda x: x[x > 0]},
    {"id": "constant-bool-row-mask", "func": lambda x: x[torch.tensor([True, False, True])]},
    {"id": "list-index", "func": lambda x: x[[2, 0]]},
    {"id": "tensor-index", "func": lambda x: x[torch.tensor([1, 1, 0])]},
    {"id": "argmax-index", "func": lambda x: x[torch.arange(x.shape[0]), x.argmax(1)]},
    {"id": "slice-cols", "func": lambda x: x[:, 1:3]},
    {"id": "ellipsis-None", "func": lambda x: x[..., None]},
    {"id": "None-and-int", "func": lambda x: x[:, None, 0]},
    {"id": "last-row", "func": lambda x: x[-1]},
    {"id": "scalar-element", "func": lambda x: x[0, 2]},
    {"id": "strided-slice", "func": lambda x: x[1:, ::2]},
    {"id": "permute", "func": lambda x: x.permute(2, 0, 1), "input_shape": (B, 2, 4)},
    {"id": "transpose", "func": lambda x: x.transpose(0, 1)},
    {"id": "T", "func": lambda x: x.T},
    {"id": "mT", "func": lambda x: x.mT, "input_shape": (B, 2, 4)},
    {"id": "movedim", "func": lambda x: x.movedim(0, -1), "input_shape": (B, 2, 4)},
    {"id": "flatten-all", "func": lambda x: x.flatten(), "input_shape": (B, 2, 4)},
    {"id": "flatten-1", "func": lambda x: torch.flatten(x, 1), "input_shape": (B, 2, 4)},
    {"id": "unflatten", "func": lambda x: x.unflatten(1, (2, 2))},
    {"id": "squeeze-unsqueeze", "func": lambda x: (x[:, None].squeeze(1), x.unsqueeze(0), x.unsqueeze(-1))},
    {"id": "squeeze-all", "func": lambda x: x.squeeze(), "input_shape": (B, 1, 4)},
    {"id": "expand", "func": lambda x: x.unsqueeze(-1).expand(-1, -1, 3)},
    {"id": "expand-new-leading-dim", "func": lambda x: x.expand(2, B, 4)},
    {"id": "expand_as-constant", "func": lambda x: x[:, :1].expand_as(const(B, 4))},
    {"id": "reshape-mixing-batch", "func": lambda x: x.reshape(2, -1)},
    {"id": "view-minus-one", "func": lambda x: x.view(-1, 2)},
    {"id": "reshape-flat", "func": lambda x: x.reshape(-1)},
    {"id": "contiguous-after-t", "func": lambda x: x.t().contiguous().view(-1)},
    {"id": "cat-constant-dim0", "func": lambda x: torch.cat([x, const(2, 4)], 0)},
    {"id": "cat-constant-dim1", "func": lambda x: torch.cat([x, const(B, 2)], 1)},
    {"id": "cat-three-first-constant", "func": lambda x: torch.cat([const(1, 4), x, x.sin()])},
    {"id": "stack-constant-dim0", "func": lambda x: torch.stack([x, const(B, 4)], 0)},
    {"id": "stack-constant-dim1", "func": lambda x: torch.stack([x, const(B, 4)], 1)},
    {"id": "stack-last", "func": lambda x: torch.stack([x, 2 * x], -1)},
    {"id": "hstack-vstack", "func": lambda x: (torch.hstack([x, const(B, 1)]), torch.vstack([const(1, 4), x]))},
    {"id": "pad-constant", "func": lambda x: F.pad(x, (1, 2), value=0.5)},
    {"id": "pad-reflect", "func": lambda x: F.pad(x, (1, 1), mode="reflect"), "input_shape": (B, 2, 4)},
    {"id": "pad-every-dim", "func": lambda x: F.pad(x, (1, 0, 2, 1), value=-1.0)},
    {"id": "constant_pad_nd", "func": lambda x: torch.constant_pad_nd(x, (1, 2, 0, -1), 0.5), "input_shape": (B, 2, 4)},
    {"id": "constant_pad_nd-every-dim", "func": lambda x: torch.constant_pad_nd(x, (1, 1, 1, 1, 1, 1)),
     "input_shape": (B, 2, 4)},
    {"id": "sum-dim0", "func": lambda x: x.sum(0)},
    {"id": "sum-scalar", "func": lambda x: x.sum()},
    {"id": "mean-scalar-times-2", "func": lambda x: x.mean() * 2},
    {"id": "mean-dims", "func": lambda x: x.mean((0, 1)), "input_shape": (B, 2, 4)},
    {"id": "sum-keepdim", "func": lambda x: x.sum(1, keepdim=True) * x},
    {"id": "cumsum-dim0", "func": lambda x: x.cumsum(0)},
    {"id": "manual-batchnorm-std", "func": lambda x: (x - x.mean(0)) / x.std(0)},
    {"id": "manual-batchnorm-var", "func": lambda x: (x - x.mean(0)) / (x.var(0, unbiased=False) + 1e-5).sqrt()},
    {"id": "manual-cumprod", "func": lambda x: x.cumprod(1), "fallback": True},
    {"id": "split", "func": lambda x: torch.split(x, [1, 2], 0)},
    {"id": "split-dim1", "func": lambda x: x.split(3, 1)},
    {"id": "chunk", "func": lambda x: x.chunk(2, 1)},
    {"id": "unbind-0", "func": lambda x: x.unbind(0)},
    {"id": "unbind-1", "func": lambda x: torch.unbind(x, 1)},
    {"id": "tensor_split", "func": lambda x: torch.tensor_split(x, 3, dim=1)},
    {"id": "setitem-zeros_like-buffer", "func": buffer_from_zeros_like},
    {"id": "setitem-new_zeros-masked", "func": buffer_new_zeros_masked},
    {"id": "inplace-on-slices", "func": inplace_on_slices},
    {"id": "parameter-with-doubled-batch-shape", "module": DoubledBatchWeight},
    {"id": "detach-is-a-constant", "func": lambda x: x * x.detach()},
]


@cases(SHAPE_SETTINGS)
def test_user_code(setting):
    run_setting(setting)


def test_logical_shape_inside_func():
    """Inside func the clone reports the primal's shape, also for several tangents at once."""
    seen = {}

    def f(x):
        seen.update(shape=tuple(x.shape), len=len(x), size0=x.size(0))
        return x

    x = torch.randn(B, 4, dtype=D)
    jvpreg.jvp(f, (x,), (torch.randn(5, B, 4, dtype=D),), batched_tangents=True)
    assert seen == {"shape": (B, 4), "len": B, "size0": B}


def test_batch_independent_output_gets_zero_tangent():
    """An output that does not depend on the input is returned with a zero tangent."""
    c = const(2, 2)
    y, t = jvpreg.jvp(lambda x: (x.sin(), c), (torch.randn(B, 4, dtype=D),), (torch.randn(B, 4, dtype=D),))
    assert torch.equal(y[1], c) and torch.equal(t[1], torch.zeros_like(c))


def test_inplace_self_product_on_a_view():
    """``v.mul_(v)`` on a view: tangent 2 v u (analytic reference: torch.func.jvp gets this aliasing case
    wrong in torch 2.15, it returns x u + x^2 u)."""

    def f(x):
        h = x * 1
        v = h[:, 1:3]
        v.mul_(v)
        return h

    torch.manual_seed(0)
    x, u = torch.randn(B, 4, dtype=D), torch.randn(B, 4, dtype=D)
    with fallback_mode("error"):
        y, t = jvpreg.jvp(f, (x,), (u,))
    expected = u.clone()
    expected[:, 1:3] = 2 * x[:, 1:3] * u[:, 1:3]
    torch.testing.assert_close(t, expected, rtol=RTOL, atol=1e-12)
