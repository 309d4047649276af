"""``engine="graphed"``: the compiled program replayed as CUDA graphs on CUDA (Inductor's ``triton.cudagraphs``).
Off the GPU: compiled as ``engine="compiled"`` with one warning, exact; the graphs themselves are checked on CUDA
(marked ``gpu``, skipped without one)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import jvpreg
from jvpreg.clone.program import capture


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def test_graphs_are_asked_for_on_cuda_only():
    assert capture.graphed_options("cuda") == {"triton.cudagraphs": True}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert capture.graphed_options("cpu") == capture.inductor_options("cpu")
    assert any("need CUDA tensors" in str(w.message) for w in seen) or ("graphed", "cpu") in capture._WARNED


@pytest.mark.slow
def test_graphed_engine_on_the_cpu_is_the_compiled_program_with_one_warning():
    net = _net().double()
    x, u = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    capture._WARNED.discard(("graphed", "cpu"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            y, t = jvpreg.jvp(net, (x,), (u,), engine="graphed")
    ref = torch.func.jvp(net, (x,), (u,))
    torch.testing.assert_close(t, ref[1], rtol=1e-10, atol=1e-12)
    assert sum("need CUDA tensors" in str(w.message) for w in seen) == 1
    progs = [p for p in capture.programs(net).values() if p.gm is not None]
    assert len(progs) == 1 and progs[0].compiled is not None and progs[0].replays == 3


def test_the_engine_is_validated_and_named_in_the_callbacks():
    from jvpreg.callbacks import JacobianRegularizer

    assert JacobianRegularizer(weight=0.1, engine="graphed").engine == "graphed"
    with pytest.raises(ValueError, match="'graphed'"):
        jvpreg.jvp(_net(), (torch.randn(2, 6),), (torch.randn(2, 6),), engine="graph")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_regularized_step_on_cuda_matches_the_captured_one():
    net = _net().cuda()
    x, u = torch.randn(32, 6, device="cuda"), torch.randn(32, 6, device="cuda")
    want = jvpreg.jvp(net, (x,), (u,), engine="captured")[1]
    for _ in range(4):
        got = jvpreg.jvp(net, (x,), (u,), engine="graphed")[1].clone()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
