"""jvpreg called from a ``torch.compile``-d function (a whole training step compiled): it runs between the graphs.

Dynamo cannot trace the engine (clone tensors, the rules' Python, its own capture), so the public entry points
(``jvpreg.jvp``, ``jvp_params``, ``pack``/``call``/``unpack``, the penalties and ``regularized_forward``) are
``torch.compiler.disable``-d: Dynamo breaks its graph there and they run as plain Python, with whichever engine was
asked for (``engine="compiled"`` still compiles its own program). Before, every such call failed inside Dynamo
("Attempt to trace forbidden callable", "__get__ was called on a clone batch outside a clone forward").
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jvpreg
from jvpreg.clone.program import capture
from jvpreg.losses import JacobianFrobenius, ParameterSensitivity, Stack, TangentProp, regularized_forward

D = torch.float64


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3), nn.LayerNorm(3)).to(D)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)).to(D)


@pytest.mark.parametrize("engine", ["eager", "auto", "captured",
                                    pytest.param("compiled", marks=pytest.mark.slow)])
def test_jvp_inside_a_compiled_function(engine):
    torch._dynamo.reset()
    model = _mlp()
    x, u = torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D)
    want = torch.func.jvp(model, (x,), (u,))
    fn = torch.compile(lambda a, b: jvpreg.jvp(model, (a,), (b,), engine=engine))
    for _ in range(3):  # "auto" captures on the second call
        out, tangent = fn(x, u)
        torch.testing.assert_close(out, want[0], rtol=1e-12, atol=0)
        torch.testing.assert_close(tangent, want[1], rtol=1e-10, atol=1e-13)
    if engine != "eager":
        programs = capture.programs(model).values()
        assert any(p.gm is not None for p in programs), "no program recorded"
    if engine == "compiled":
        assert any(p.compiled is not None for p in programs), "engine='compiled' did not compile its program"


def test_the_low_level_trio_inside_a_compiled_function():
    """Clone batches between ``pack``, ``call`` and ``unpack`` cannot cross into a graph: a clear error that says
    what to do, and what it says works."""
    torch._dynamo.reset()
    model = _mlp()
    x, u = torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D)

    def trio(a, b):
        clones, s = jvpreg.clone.pack((a,), (b[None],))
        return jvpreg.clone.unpack(jvpreg.clone.call(model, clones), s, batched=False)

    @torch.compiler.disable
    def trio_between_graphs(a, b):
        clones, s = jvpreg.clone.pack((a,), (b[None],))
        return jvpreg.clone.unpack(jvpreg.clone.call(model, clones), s, batched=False)

    with pytest.raises(Exception, match="crossed into a torch.compile-d graph"):
        torch.compile(trio, backend="aot_eager")(x, u)
    got = torch.compile(lambda a, b: trio_between_graphs(a, b) + (a.sum(),), backend="aot_eager")(x, u)[1]
    torch.testing.assert_close(got, torch.func.jvp(model, (x,), (u,))[1], rtol=1e-10, atol=1e-13)


def test_jvp_params_inside_a_compiled_function():
    model = _mlp()
    x = torch.randn(4, 8, dtype=D)
    w = torch.randn_like(model[0].weight)
    got = torch.compile(lambda a: jvpreg.jvp_params(model, (a,), {"0.weight": w}), backend="aot_eager")(x)[1]
    params = dict(model.named_parameters())
    want = torch.func.jvp(lambda v: torch.func.functional_call(model, {**params, "0.weight": v}, (x,)),
                          (params["0.weight"].detach(),), (w,))[1]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


PENALTIES = {
    "JacobianFrobenius": lambda: JacobianFrobenius(seed=0),
    "Stack": lambda: Stack([JacobianFrobenius(seed=0), TangentProp(transforms=("translate_x",))]),
    "regularized_forward": lambda: (lambda model, a: regularized_forward(
        model, a, [JacobianFrobenius(seed=0), ParameterSensitivity("*weight", seed=0)])),
}


@pytest.mark.parametrize("backend", [pytest.param("aot_eager", marks=pytest.mark.slow),
                                     pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_a_compiled_training_step_with_a_penalty(penalty, backend):
    """A whole step (forward, penalty, backward) under torch.compile: its gradients and train-mode BatchNorm's
    running statistics equal the uncompiled step's."""
    torch._dynamo.reset()
    x, y = torch.randn(4, 1, 8, 8, dtype=D), torch.randint(0, 3, (4,))
    results = []
    for compiled in (False, True):
        model, reg = _cnn(), PENALTIES[penalty]()

        def step(a, b):
            out, pen = reg(model, a)
            loss = F.cross_entropy(out, b) + 0.1 * pen
            loss.backward()
            return loss.detach()

        run = torch.compile(step, backend=backend) if compiled else step
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            run(x, y)
        results.append(([p.grad for p in model.parameters()], [b.clone() for b in model.buffers()]))
    (grads, buffers), (grads_c, buffers_c) = results
    for g, gc in zip(grads, grads_c):
        torch.testing.assert_close(gc, g, rtol=1e-10, atol=1e-13)
    for b, bc in zip(buffers, buffers_c):
        torch.testing.assert_close(bc, b, rtol=0, atol=0)


def test_fullgraph_refuses_with_the_reason():
    torch._dynamo.reset()
    model = _mlp()
    x = torch.randn(4, 8, dtype=D)
    with pytest.raises(Exception, match="runs between torch.compile graphs"):
        torch.compile(lambda a: jvpreg.jvp(model, (a,), (a,)), fullgraph=True, backend="eager")(x)
