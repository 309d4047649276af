"""Activation checkpointing (``torch.utils.checkpoint``) inside a clone forward (``jvpreg.clone.eager.checkpointing``).

References, in float64: the gradients of the same regularized step without checkpointing (equal to 1e-12), and the
buffers of a plain checkpointed step (BatchNorm's running statistics, updated again by the recomputation in both).
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import jvpreg
from conftest import load_script
from jvpreg.bench import memory
from jvpreg.clone import JVPCaptureWarning
from jvpreg.clone.program import capture
from jvpreg.clone.program.checkpointed_regions import CheckpointedRegion
from jvpreg.losses import JacobianFrobenius, ParameterSensitivity, Stack, regularized_forward

D = torch.float64


class Block(nn.Module):
    def __init__(self, width=16, bn=False, drop=0.0):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width) if bn else nn.Identity()
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return x + self.b(self.drop(torch.relu(self.bn(self.a(x)))))


class Net(nn.Module):
    """Residual blocks, each checkpointed when ``reentrant`` is a bool (``None``: no checkpointing)."""

    def __init__(self, reentrant=None, depth=3, width=16, **block):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width, **block) for _ in range(depth)])
        self.head = nn.Linear(width, 4)
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            if self.reentrant is None:
                x = block(x)
            else:
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


X = torch.randn(8, 16, dtype=D, generator=torch.Generator().manual_seed(0))
Y = torch.arange(8) % 4


def penalties(weights: bool):
    if not weights:
        return JacobianFrobenius(seed=0)
    return Stack([JacobianFrobenius(seed=0), ParameterSensitivity(params=("*weight",), seed=1)])


def regularized_steps(model, engine, weights=False, steps=3):
    """Three SGD-free steps (the same weights each time): the last step's gradients and the buffers."""
    for _ in range(steps):
        torch.manual_seed(5)  # the same dropout masks with and without checkpointing
        model.zero_grad()
        out, pen = regularized_forward(model, X, penalties(weights), target=Y, engine=engine)
        (F.cross_entropy(out, Y) + pen).backward()
    return [p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()]


def plain_steps(model, steps=3):
    for _ in range(steps):
        torch.manual_seed(5)
        model.zero_grad()
        F.cross_entropy(model(X), Y).backward()
    return [b.clone() for b in model.buffers()]


def region_count(model):
    """Checkpointed regions in ``model``'s captured programs."""
    return sum(isinstance(m, CheckpointedRegion) for p in capture.programs(model).values() if p.gm is not None
               for m in p.gm.children())


def assert_equal_lists(got, want, rtol):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=0)


@pytest.mark.parametrize("weights", [False, True], ids=["input", "input+weights"])
@pytest.mark.parametrize("block", [{}, {"bn": True}, {"drop": 0.3}, {"bn": True, "drop": 0.3}],
                         ids=["plain", "batchnorm", "dropout", "batchnorm+dropout"])
@pytest.mark.parametrize("engine", ["eager", pytest.param("captured", marks=pytest.mark.slow)])
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradients_equal_those_without_checkpointing(reentrant, engine, block, weights):
    torch.manual_seed(0)
    base = Net(**block).to(D)
    want, _ = regularized_steps(copy.deepcopy(base), "eager", weights)
    model = copy.deepcopy(base)
    model.reentrant = reentrant
    with warnings.catch_warnings():
        warnings.simplefilter("error", JVPCaptureWarning)
        got, buffers = regularized_steps(model, engine, weights)
    assert_equal_lists(got, want, rtol=1e-12)
    assert region_count(model) == (3 if engine == "captured" else 0)
    if not reentrant:  # BatchNorm's statistics: updated by the recomputation too, as in a plain checkpointed step
        # (the reentrant form drops the first block's graph when its input needs no gradient; the clone forward
        # runs the non-reentrant form, whose gradients are right there)
        plain = copy.deepcopy(base)
        plain.reentrant = reentrant
        assert_equal_lists(buffers, plain_steps(plain), rtol=0)


@pytest.mark.slow
def test_checkpointing_keeps_the_memory_of_a_checkpointed_2b_forward():
    """The live-tensor peak of a regularized step with checkpointing, eager or captured, is that of a plain
    checkpointed step on the doubled batch (the clone batch's floor), and well below the regularized step without
    checkpointing."""
    torch.manual_seed(0)
    x = torch.randn(128, 128)

    def live_peak(reentrant, regularized, engine="eager"):
        model = Net(reentrant, depth=16, width=128)

        def step():
            if regularized:
                out, pen = regularized_forward(model, x, JacobianFrobenius(), engine=engine)
                (out.square().mean() + pen).backward()
            else:
                model(torch.cat([x, x])).square().mean().backward()

        step()
        step()  # the captured engine's program is recorded
        return memory.peak_live_bytes(step)

    without = live_peak(None, True)
    if without is None:
        pytest.skip("torch.profiler's memory timeline is not available")
    plain_checkpointed = live_peak(False, False)
    for engine in ("eager", "captured"):
        with_checkpoints = live_peak(False, True, engine)
        assert with_checkpoints < 0.6 * without, engine
        assert with_checkpoints < 1.1 * plain_checkpointed, engine


def test_captured_program_calls_each_region_through_checkpoint():
    """With gradients, each region of the program is a checkpointed sub-program (no warning, no eager fallback);
    without gradients nothing is saved for backward and the regions stay inline."""
    torch.manual_seed(0)
    model = Net(reentrant=False).to(D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", JVPCaptureWarning)
        regularized_steps(model, "auto")
    (prog,) = capture.programs(model).values()
    regions = [m for m in prog.gm.children() if isinstance(m, CheckpointedRegion)]
    assert len(regions) == 3 and all(r.options == {} for r in regions)  # checkpoint's defaults
    calls = []
    original = torch_checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return original(*args, **kwargs)

    torch_checkpoint.checkpoint = counting
    try:
        regularized_steps(model, "captured", steps=1)
    finally:
        torch_checkpoint.checkpoint = original
    assert calls == [False] * 3
    model.eval()
    capture.reset(model)
    u = torch.randn_like(X)
    plain = copy.deepcopy(model)
    plain.reentrant = None  # torch.func.jvp fails inside a checkpoint on older torch
    want = torch.func.jvp(plain, (X,), (u,))[1]
    with torch.no_grad():
        for _ in range(2):
            _, t = jvpreg.jvp(model, (X,), (u,), engine="captured")
    assert region_count(model) == 0 and any(p.gm is not None for p in capture.programs(model).values())
    torch.testing.assert_close(t, want, rtol=1e-12, atol=0)


def test_a_clone_outside_a_clone_forward_answers_metadata_and_refuses_ops():
    """The recomputation's check reads a saved clone's shape after the clone forward: the physical batch's."""
    (cx,), _ = jvpreg.clone.pack((X,), (torch.randn(1, *X.shape, dtype=D),))
    assert cx.shape == (2, *X.shape) and cx.dtype == D and cx.device == X.device
    with pytest.raises(RuntimeError, match="outside a clone forward"):
        cx.exp()


def _zoo_step(model, x, engine):
    for _ in range(2):
        model.zero_grad()
        torch.manual_seed(1)
        out, pen = regularized_forward(model, x, JacobianFrobenius(seed=0), engine=engine)
        (out.square().mean() + pen).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("source, name", [("timm", "test_vit"), ("timm", "resnet18d"), ("hf", "llama"),
                                          ("hf", "bert")])
@pytest.mark.slow
def test_timm_and_hugging_face_checkpointing(source, name):
    """timm's ``set_grad_checkpointing`` and Hugging Face's ``gradient_checkpointing_enable``, train mode: the
    gradients of each engine's step without checkpointing (Hugging Face's float64 models compute their norms in
    float32, so the engines agree with each other only to float32 rounding there), and the captured step replays
    the checkpointed regions."""
    zoo = load_script("model_zoo_sweep")
    torch.manual_seed(0)
    model, call, x, _ = (zoo._timm if source == "timm" else zoo._hf)(name)
    model.train()
    engines = ("eager", "captured")
    want = {engine: _zoo_step(call(copy.deepcopy(model)), x, engine) for engine in engines}
    if source == "timm":
        model.set_grad_checkpointing(True)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it
            model.gradient_checkpointing_enable()
    f = call(model)
    for engine in engines:
        with warnings.catch_warnings():
            warnings.simplefilter("error", JVPCaptureWarning)
            got = _zoo_step(f, x, engine)
        assert got.keys() == want[engine].keys()
        for n, w in want[engine].items():  # relative to the largest entry: regions may round small entries apart
            assert (got[n] - w).abs().max() <= 1e-12 * w.abs().max(), (engine, n)
    assert region_count(f) > 0


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, scale=1.0):
        return torch.tanh(self.a(x)) * scale, self.b(x).relu()


def _save_matmuls(ctx, op, *args, **kwargs):
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    policy = torch_checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if op in matmuls else policy.PREFER_RECOMPUTE


class Regions(nn.Module):
    """Checkpointed regions as models write them: keyword arguments and tuple outputs, nested regions,
    ``checkpoint_sequential``, selective checkpointing, reentrant regions, a region whose Python reads a value it
    computes; ``layout=None`` runs the same computation without checkpointing."""

    def __init__(self, layout=None):
        super().__init__()
        self.pair = Pair()
        self.seq = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.SiLU())
        self.head = nn.Linear(16, 4)
        self.layout = layout

    def forward(self, x):
        def cp(fn, *args, **kwargs):
            return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)

        if self.layout is None:
            a, b = self.pair(x, scale=0.5)
            y = self.seq(a + b)
        elif self.layout == "kwargs_and_tuple":
            a, b = cp(self.pair, x, scale=0.5)
            y = self.seq(a + b)
        elif self.layout == "nested":
            def outer(z):
                a, b = cp(self.pair, z, scale=0.5)
                return cp(self.seq, a + b)

            y = cp(outer, x)
        elif self.layout == "reentrant":  # the region reads perturbed weights; its input may hold no clone
            a, b = torch_checkpoint.checkpoint(self.pair, x, 0.5, use_reentrant=True)
            y = torch_checkpoint.checkpoint(self.seq, a + b, use_reentrant=True)
        elif self.layout == "selective":  # selective activation checkpointing: the matmuls saved, the rest recomputed
            context = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, _save_matmuls)
            a, b = cp(self.pair, x, scale=0.5, context_fn=context)
            y = cp(self.seq, a + b, context_fn=context)
        elif self.layout == "value_read":  # Python reads a value the region computes: the capture guards it
            def gated(z):
                h = self.seq(z)
                return h * 2 if bool((h.abs() > 1e6).any()) else h

            a, b = self.pair(x, scale=0.5)
            y = cp(gated, a + b)
        elif self.layout == "no_grad_edges":  # a region that starts and ends under no_grad (grad-mode switches)
            def scaled(z):
                with torch.no_grad():
                    s = (z * 0).sum() + 1  # 1, no tangent, no gradient
                h = self.seq(z) / s
                with torch.no_grad():
                    s.mul_(1)
                return h

            a, b = self.pair(x, scale=0.5)
            y = cp(scaled, a + b)
        else:  # "sequential"
            a, b = self.pair(x, scale=0.5)
            y = torch_checkpoint.checkpoint_sequential(self.seq, 2, a + b, use_reentrant=False)
        return self.head(y)


REGION_PENALTIES = {
    "input": lambda: JacobianFrobenius(seed=0),
    "weights_only": lambda: ParameterSensitivity(params=("*weight",), seed=1),  # the input is no clone batch
    "both": lambda: Stack([JacobianFrobenius(2, seed=0), ParameterSensitivity(params=("seq.*",), seed=1)]),
}


@pytest.mark.parametrize("penalty", sorted(REGION_PENALTIES))
@pytest.mark.parametrize("layout", ["kwargs_and_tuple", *(pytest.param(layout, marks=pytest.mark.slow) for layout in (
    "nested", "sequential", "selective", "reentrant", "value_read", "no_grad_edges"))])
def test_nested_keyword_and_sequential_regions(layout, penalty):
    torch.manual_seed(0)
    base = Regions().to(D)

    def grads(model):
        with warnings.catch_warnings():
            warnings.simplefilter("error", JVPCaptureWarning)
            for _ in range(3):
                model.zero_grad()
                out, pen = regularized_forward(model, X, REGION_PENALTIES[penalty](), target=Y)
                (F.cross_entropy(out, Y) + pen).backward()
        return [p.grad.clone() for p in model.parameters()]

    want = grads(copy.deepcopy(base))
    model = copy.deepcopy(base)
    model.layout = layout
    assert_equal_lists(grads(model), want, rtol=1e-12)
    # captured from the second step on: the nested region joins the outer one, checkpoint_sequential leaves the
    # last segment unchecked
    assert region_count(model) == {"nested": 1, "sequential": 1, "kwargs_and_tuple": 1, "value_read": 1,
                                   "no_grad_edges": 1}.get(layout, 2)


@pytest.mark.slow
def test_compiled_engine_keeps_the_regions():
    """``engine="compiled"``: torch.compile reads each region's sub-program through its checkpoint; the gradients of
    the step without checkpointing and, as for any checkpoint under torch.compile (whose recomputation repeats no
    buffer update), BatchNorm's statistics of a plain step (to Inductor's rounding)."""
    torch.manual_seed(0)
    base = Net(bn=True, drop=0.3).to(D)
    want, _ = regularized_steps(copy.deepcopy(base), "eager", weights=True)
    model = copy.deepcopy(base)
    model.reentrant = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", JVPCaptureWarning)
        got, buffers = regularized_steps(model, "compiled", weights=True)
    scale = max(w.abs().max() for w in want)  # the bias before BatchNorm has a gradient of rounding noise
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12 * scale)
    for b, w in zip(buffers, plain_steps(copy.deepcopy(base))):  # torch.compile recomputes no buffer update
        torch.testing.assert_close(b, w, rtol=1e-12, atol=1e-15)
    assert region_count(model) == 3
