"""``torch.compile``-d functions called inside a clone forward run their original code
(``jvpreg/clone/eager/compiled_code.py``).

Reference: ``torch.func.jvp`` of the same model with the helper uncompiled, in float64.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import jvpreg
from jvpreg.clone.program import capture
from jvpreg.clone.eager import forward
from conftest import assert_as_plain, count_captures, load_script

D = torch.float64


def _stance() -> str:
    return torch._dynamo.eval_frame._stance.stance


def gated(t):
    return torch.tanh(t) * torch.sigmoid(2 * t)


class WithCompiledHelper(nn.Module):
    def __init__(self, helper):
        super().__init__()
        self.a, self.b, self.helper = nn.Linear(6, 6), nn.Linear(6, 3), helper

    def forward(self, x):
        return self.b(self.helper(self.a(x)))


@pytest.mark.parametrize("engine", ["eager", "captured", pytest.param("compiled", marks=pytest.mark.slow)])
def test_a_compiled_helper_runs_its_original_code(engine):
    torch.manual_seed(0)
    model = WithCompiledHelper(torch.compile(gated, backend="eager")).to(D)
    plain = copy.deepcopy(model)
    plain.helper = gated
    x, u = torch.randn(4, 6, dtype=D), torch.randn(4, 6, dtype=D)
    _, want = torch.func.jvp(plain, (x,), (u,))
    with count_captures() as n:
        for _ in range(2):
            y, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
    torch.testing.assert_close(t, want, rtol=1e-12, atol=0)
    assert_as_plain(y, plain(x), "output")
    assert _stance() == "default" and torch._dynamo.config.error_on_nested_fx_trace  # put back
    if engine != "eager":  # one program recorded, replayed by both calls
        assert n.recorded == 1 and len(capture.programs(model)) == 1
        n.ran_programs(2)


@pytest.mark.slow
def test_the_compiled_engine_still_compiles_inside_a_clone_forward():
    """The callbacks run the clone forward inside ``forward.active()``: the compiled engine's program must not
    inherit the forced-eager stance there."""
    torch.manual_seed(0)
    model = WithCompiledHelper(gated).to(D)
    x, u = torch.randn(4, 6, dtype=D), torch.randn(4, 6, dtype=D)
    torch._dynamo.utils.counters.clear()
    with forward.active():
        assert _stance() == "force_eager"
        jvpreg.jvp(model, (x,), (u,), engine="compiled")
        assert _stance() == "force_eager"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert _stance() == "default"


class LastHidden(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, z):
        return self.model(inputs_embeds=z).last_hidden_state


def _zoo():
    return load_script("model_zoo_sweep")


@pytest.mark.slow
def test_hugging_face_flex_attention_is_exact():
    """``attn_implementation="flex_attention"``: Hugging Face calls a compiled flex_attention."""
    import transformers
    zoo = _zoo()
    cfg, _ = zoo._hf_config("llama")
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg, attn_implementation="flex_attention").to(D).eval()
    ref = transformers.AutoModel.from_config(copy.deepcopy(cfg), attn_implementation="eager").to(D).eval()
    ref.load_state_dict(model.state_dict())
    x, u = torch.randn(2, 10, 32, dtype=D), torch.randn(2, 10, 32, dtype=D)
    call = LastHidden(model)
    with zoo.float64_throughout(), warnings.catch_warnings():  # HF's eager attention: softmax in float32
        warnings.simplefilter("ignore")
        _, want = torch.func.jvp(lambda z: ref(inputs_embeds=z).last_hidden_state, (x,), (u,))
        with torch.no_grad():  # flex_attention has no backward on the CPU
            for engine in ("eager", "captured", "compiled"):
                for _ in range(2):
                    _, t = jvpreg.jvp(call, (x,), (u,), engine=engine)
                torch.testing.assert_close(t, want, rtol=1e-12, atol=1e-14, msg=engine)
