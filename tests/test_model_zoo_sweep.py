"""scripts/model_zoo_sweep.py: its checks run and judge, on one small model of each source (no downloads)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import load_script


@pytest.fixture(scope="module")
def zoo():
    return load_script("model_zoo_sweep")


def test_float64_throughout_makes_float32_casts_no_ops_and_restores_them(zoo):
    x = torch.randn(3, dtype=torch.float64)
    with zoo.float64_throughout():
        assert x.float() is x and x.to(torch.float32) is x
        assert F.softmax(x, 0, dtype=torch.float32).dtype == torch.float64
        assert x.to(torch.float16).dtype == torch.float16  # only float32 casts
    assert x.float().dtype == torch.float32 and F.softmax(x, 0, dtype=torch.float32).dtype == torch.float32


def test_exact_hardsigmoid_has_slope_one_sixth_in_float64(zoo):
    x = torch.linspace(-2.5, 2.5, 11, dtype=torch.float64)
    u = torch.randn_like(x)
    _, t = torch.func.jvp(F.hardsigmoid, (x,), (u,))
    assert not torch.equal(t, u / 6)  # torch's kernel: a float32 1/6
    with zoo.exact_hardsigmoid():
        _, t = torch.func.jvp(F.hardsigmoid, (x,), (u,))
    torch.testing.assert_close(t, u / 6, rtol=1e-15, atol=0)


@pytest.mark.sweep  # 30-60 s a model
@pytest.mark.parametrize("source, name", [("timm", "test_resnet"), ("hf", "llama"),
                                          pytest.param("hf", "mixtral")])  # MoE routing
def test_check_one_finds_both_engines_exact(zoo, source, name):
    row = zoo.check_one(source, name)
    assert row["verdict"] == "exact", row
    assert row["error64_eager"] <= zoo.EXACT and row["error64_captured"] <= zoo.EXACT
    assert row["fallback_ops"] == []
    if source == "timm":  # HF's SDPA mask preparation reads the mask's values: eager clone mode there
        assert row["not_captured"] == ""
    if name == "llama":  # its RMSNorm's variance is computed in float32: as written, less accurate than in float64
        assert row["error64_eager"] * 100 < row["error_eager"] < 1e-6
    # on the meta device: the timm model's JVP reads no value; HF's mask checks read one in a plain forward too
    assert row["host_reads"] == ("none" if source == "timm" else "the model's own forward")
    # its own activation checkpointing on, a regularized step has the gradients of the step without it
    assert row["checkpointing"].startswith("regularized step") and row["error64_checkpointing"] <= zoo.EXACT


def test_markdown_lists_every_row(zoo):
    rows = [{"source": "timm", "model": "m1", "input": "2x3", "reference": "torch.func.jvp", "error_eager": 1e-16,
             "error_captured": 2e-16, "error64_eager": 1e-16, "error64_captured": 2e-16, "verdict": "exact",
             "first_call_s_eager": 0.1, "first_call_s_captured": 1.0, "fallback_ops": ["torch.celu"],
             "not_captured": "torch.celu has no clone rule", "host_reads": "the model's own forward",
             "checkpointing": "regularized step, eager and auto", "error64_checkpointing": 0.0},
            {"source": "hf", "model": "m2", "verdict": "error", "error": "timed out after 300 s"}]
    md = zoo.to_markdown(rows, "python scripts/model_zoo_sweep.py")
    assert "`m1`" in md and "torch.celu" in md and "the model's own forward" in md
    assert "0.0e+00 (regularized step, eager and auto)" in md and "timed out" in md and "error 1, exact 1" in md


@pytest.mark.slow
def test_checkpointing_column_compares_only_models_whose_checkpointed_forward_is_the_same(zoo):
    class Net(torch.nn.Module):
        def __init__(self, changes):
            super().__init__()
            self.a, self.b, self.ckpt, self.changes = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), False, changes

        def set_grad_checkpointing(self, enable=True):
            self.ckpt = enable

        def forward(self, x):
            if self.ckpt:
                h = torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False)
                return self.b(torch.tanh(h + (1.0 if self.changes else 0.0)))
            return self.b(torch.tanh(self.a(x)))

    x = torch.randn(3, 4, dtype=torch.float64)
    what, err = zoo.checkpointing("timm", Net(False).double(), lambda m: m, x)
    assert what == "regularized step, eager and captured (1 checkpointed region replayed)" and err <= zoo.EXACT
    what, err = zoo.checkpointing("timm", Net(True).double(), lambda m: m, x)
    assert "differs from its plain one" in what and err is None
    what, err = zoo.checkpointing("hf", Net(False).double(), lambda m: m, x)  # no gradient_checkpointing_enable
    assert what.startswith("no checkpointing") and err is None
