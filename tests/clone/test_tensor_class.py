"""Libraries that dispatch on the array's class module see a clone batch as torch's own tensor.

opt_einsum's ``infer_backend(x) = x.__class__.__module__.split('.')[0]`` (reached by tensorly's opt_einsum plugin
in neuraloperator's FNO) picked the "jvpreg" backend for a clone batch, found no ``jvpreg.tensordot`` and fell back
to numpy, which failed on it (``Can't call numpy() on Tensor that requires grad``)."""
from __future__ import annotations

import opt_einsum
from opt_einsum.contract import infer_backend
import pytest
import torch
from conftest import assert_tree_close

import jvpreg
from jvpreg.clone.core.tensor import CloneTensor


def test_clone_class_reports_torch_as_its_module():
    assert CloneTensor.__module__.split(".")[0] == "torch"
    assert infer_backend(torch.empty(0).as_subclass(CloneTensor)) == "torch"


@pytest.mark.parametrize("engine", ["eager", "captured"])
def test_opt_einsum_contraction_of_a_clone_batch_is_the_exact_jvp(engine):
    """``y = contract('bi,ij,jk->bk', x, W1, W2)`` with the backend inferred from ``x`` (a clone batch inside the
    forward): the inferred backend is torch and the tangent is ``contract(u, W1, W2)``."""
    torch.manual_seed(0)
    d = torch.float64
    seen = []

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(5, 6, dtype=d))
            self.w2 = torch.nn.Parameter(torch.randn(6, 3, dtype=d))

        def forward(self, x):
            seen.append(infer_backend(x))
            return torch.tanh(opt_einsum.contract("bi,ij,jk->bk", x, self.w1, self.w2))

    net = Net()
    x, u = torch.randn(4, 5, dtype=d), torch.randn(4, 5, dtype=d)
    got = jvpreg.jvp(net, (x,), (u,), engine=engine)
    assert seen[-1] == "torch"
    assert_tree_close(got, torch.func.jvp(net, (x,), (u,)), what=f"opt_einsum {engine}")
    if engine == "captured":
        assert [p.gm is not None for p in jvpreg.clone.program.capture.programs(net).values()] == [True]
