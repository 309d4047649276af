"""Real client models as their users call them (:data:`jvpreg.bench.clients.CLIENTS`): exact, and captured.

Each model is built small with random weights, unmodified, and called as its library's users call it: the module,
``functools.partial(model, **conditioning)`` or a lambda. In float64, eval and train mode (dropout ``p = 0``),
``jvpreg.jvp``'s default engine must give the reference JVP to ``1e-9`` of the output's scale on every one of three
calls (the first eager, the second captures, the third replays), with SDPA on its math kernel, and must capture:
one program, replayed twice, and no ``JVPCaptureWarning`` except where :data:`EAGER` names the case and its reason.
Reference: ``torch.func.jvp``, or double backward (``torch.autograd.functional.jvp``) where torch.func refuses
train-mode BatchNorm or is itself inexact (:data:`REFERENCE`). Then a few steps of a Lightning fit with
``JacobianRegularizer(weight, module="net")`` added in one line and the library's usual loss.

The libraries are imported, not skipped: they are the ``clients`` extra of the test install (``.[dev,clients]``).
"""
from __future__ import annotations

import contextlib
import copy
import math
import warnings

import diffusers  # noqa: F401
import monai  # noqa: F401
import neuralop  # noqa: F401
import pytest
import pytorch_lightning as pl
import segmentation_models_pytorch  # noqa: F401
import timm  # noqa: F401
import torch
import torch.nn.functional as F
import torchvision  # noqa: F401
import transformers  # noqa: F401
import vit_pytorch  # noqa: F401
import x_transformers  # noqa: F401
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvpreg
from jvpreg.bench.clients import CLIENTS, MEAN_FLOW, by_name, no_dropout, to_dtype
from jvpreg.callbacks import JacobianRegularizer
from jvpreg.callbacks.scale_check import PenaltyScaleWarning
from jvpreg.clone.core.errors import JVPCaptureWarning
from jvpreg.clone.program.capture import programs

D = torch.float64
TOL = 1e-9

#: (client, mode) -> why the default engine runs it eagerly (a JVPCaptureWarning expected). None today.
EAGER: dict = {}

#: client -> reference JVP, where not torch.func.jvp in both modes. x-transformers' attention takes its softmax with
#: ``dtype=torch.float32`` (``Attend.attn_fn``): torch.func's tangent through it is float32-rounded, 7e-9 (decoder) and
#: 1.2e-8 (encoder) of the output scale from double backward and jvpreg, which agree to 2e-13; with that softmax in
#: float64 all three agree to 6e-16. Train-mode BatchNorm (``Client.train_reference``): torch.func refuses the running
#: statistics' in-place update.
REFERENCE = {"xt_encoder": "double_backward", "xt_decoder": "double_backward"}

#: clients whose fit's first penalty outweighs the task loss 100x: PenaltyScaleWarning (the others: none). Both are
#: train-mode BatchNorm on batches of 2 (the fits' size) down to a 1x1 map: statistics of 2 values, a Jacobian of
#: 1e3-1e5 per output element (timm's ResNet-18 zero-inits each block's last BatchNorm scale and stays quiet).
SCALE_WARNS = {"tv_resnet18", "smp_unet"}

#: the quick tier: eval mode of the cheapest client (1-9 s each); the sweep tier: eval mode of every other client,
#: train mode of the BatchNorm ones (train-mode statistics must be exact)
QUICK_EVAL = {"tv_vit"}


@contextlib.contextmanager
def exact_hardsigmoid():
    """``F.hardsigmoid`` as ``relu6(x + 3) / 6`` for both sides: torch's kernel's slope is a float32 1/6, 6e-10 off
    in float64 (torch.func's reference would be the inexact one)."""
    hs = F.hardsigmoid
    F.hardsigmoid = lambda input, inplace=False: F.relu6(input + 3) / 6
    try:
        yield
    finally:
        F.hardsigmoid = hs


def _reference(kind, f, x, u):
    if kind == "torch.func":
        return torch.func.jvp(f, x, u)
    out, tan = torch.autograd.functional.jvp(f, x, u)
    return out, tan


def _close(got, want, what):
    """Largest entry error over the output's scale (tuples as their ``return_dict=False`` forms give them)."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), f"{what}: structure {type(got)}"
        return max(_close(g, w, f"{what}[{i}]") for i, (g, w) in enumerate(zip(got, want)))
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item()
    assert scale > 0 and math.isfinite(scale), f"{what}: the reference is {scale} (a test that cannot fail)"
    err = (got.detach() - want.detach()).abs().max().item() / scale
    assert err <= TOL, f"{what}: relative error {err:.2e} > {TOL}"
    return err


#: train mode not run: its forward is the eval forward (no BatchNorm, dropout and drop-path 0), and its capture in
#: train mode costs 12x the eval one (24 s against 2 s of CPU on the 2-core machine, inside capture._capture)
SAME_IN_TRAIN = {"timm_convnext"}
#: train mode not run, to keep the zoo within minutes: MobileNetV3's train-mode capture costs 25 s of CPU (eval: 2 s),
#: 60-260 s of wall time on the loaded 2-core machine; its train-mode BatchNorm is covered by the ResNets, monai's
#: UNet and smp's Unet, and its fit (train mode, captured) still runs
COSTLY_CAPTURE_IN_TRAIN = {"tv_mobilenet_v3"}


def _params(mode):
    out = []
    for c in [*CLIENTS, MEAN_FLOW]:
        if mode == "train" and c.name in SAME_IN_TRAIN | COSTLY_CAPTURE_IN_TRAIN:
            continue
        slow = mode == "train" or c.name not in QUICK_EVAL
        out.append(pytest.param(c.name, marks=[pytest.mark.sweep] if slow else [], id=c.name))
    return out


def check_client(name: str, mode: str) -> dict:
    """Three default-engine JVPs against the reference; the programs recorded; returns what was seen."""
    client = MEAN_FLOW if name == MEAN_FLOW.name else by_name(name)
    torch.manual_seed(0)
    model = to_dtype(no_dropout(client.build()), D).train(mode == "train")
    # the reference runs on a copy called alike: a module that caches a tensor made inside torch.func.jvp (FNO's grid
    # embedding) would hand the capture a transform-wrapped constant (test_fno_after_torch_func_on_the_same_module)
    ref_f, _, _ = client.call(copy.deepcopy(model), 2, D, torch.Generator().manual_seed(1))
    f, x, u = client.call(model, 2, D, torch.Generator().manual_seed(1))
    kind = REFERENCE.get(name, "torch.func")
    if mode == "train" and client.train_reference == "double_backward":
        kind = "double_backward"
    errs = []
    with sdpa_kernel(SDPBackend.MATH), exact_hardsigmoid(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", JVPCaptureWarning)
        want_y, want_t = _reference(kind, ref_f, x, u)
        for i in range(3):
            y, t = jvpreg.jvp(f, x, u)
            errs.append(_close(t, want_t, f"{name} {mode} call {i + 1}: tangent vs {kind}"))
            _close(y, want_y, f"{name} {mode} call {i + 1}: output")
    warned = [str(w.message) for w in caught if issubclass(w.category, JVPCaptureWarning)]
    progs = list(programs(model).values())
    if (name, mode) in EAGER:
        assert warned and all(p.gm is None for p in progs), (name, mode, warned, progs)
    else:
        assert warned == [], f"{name} {mode}: {warned}"
        assert [(p.gm is not None, p.replays) for p in progs] == [(True, 2)], \
            f"{name} {mode} ({client.form}): programs {[(p.gm is not None, p.replays, p.reason) for p in progs]}"
    return {"errors": errs, "reference": kind}


@pytest.mark.parametrize("name", _params("eval"))
def test_client_eval_jvp_is_exact_and_captured(name):
    check_client(name, "eval")


@pytest.mark.parametrize("name", _params("train"))
def test_client_train_jvp_is_exact_and_captured(name):
    check_client(name, "train")


def test_zoo_covers_twenty_models_from_eight_libraries_and_every_call_form():
    assert len(CLIENTS) >= 20 and len({c.library for c in CLIENTS}) >= 8
    assert {c.form for c in CLIENTS} == {"module", "partial", "lambda"}
    assert set(REFERENCE) | set(SCALE_WARNS) | {n for n, _ in EAGER} <= {c.name for c in CLIENTS}


@pytest.mark.slow
def test_fno_after_torch_func_on_the_same_module():
    """neuraloperator's grid embedding caches the grid it made in the first call; made inside ``torch.func.jvp``, it
    is a transform-wrapped tensor, which the capture refuses to hold as a constant (``_check_constants``): the
    default engine then runs FNO eagerly, exact, with one JVPCaptureWarning naming the constant."""
    torch.manual_seed(0)
    model = to_dtype(by_name("fno").build(), D).eval()
    f, x, u = by_name("fno").call(model, 2, D, torch.Generator().manual_seed(1))
    want = torch.func.jvp(f, x, u)
    assert torch._C._functorch.is_functorch_wrapped_tensor(model.positional_embedding._grid[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", JVPCaptureWarning)
        for i in range(3):
            _close(jvpreg.jvp(f, x, u)[1], want[1], f"fno after torch.func, call {i + 1}")
    warned = [str(w.message) for w in caught if issubclass(w.category, JVPCaptureWarning)]
    assert len(warned) == 1 and "torch.func transform inside the forward wrapped" in warned[0], warned
    assert [p.gm is None for p in programs(model).values()] == [True]


@pytest.mark.slow
def test_mean_flow_tangents_reach_the_time_input():
    """The mean-flow JVP's tangent ``(v, 1, 0)``: ``d/dt`` differs from the ``z``-only JVP (the ``t`` direction is
    not dropped), and ``r``'s zero tangent is ``-d/dr`` of ``t``'s one only through ``t - r`` (checked as a sum)."""
    torch.manual_seed(0)
    model = to_dtype(MEAN_FLOW.build(), D).eval()
    f, (z, t, r), (v, one, zero) = MEAN_FLOW.call(model, 2, D, torch.Generator().manual_seed(1))
    with sdpa_kernel(SDPBackend.MATH):
        _, full = jvpreg.jvp(f, (z, t, r), (v, one, zero))
        _, z_only = jvpreg.jvp(f, (z, t, r), (v, zero, zero))
        _, along = jvpreg.jvp(f, (z, t, r), (torch.zeros_like(v), one, one))  # t - r fixed: no change
    assert (full - z_only).abs().max() > 1e-3 * full.abs().max()
    assert along.abs().max() <= 1e-12 * full.abs().max()


# --------------------------------------------------------------------------- fits

def _task_loss(task, out, target):
    if task == "classify":
        return F.cross_entropy(out, target)
    if task == "segment":  # cross-entropy + soft Dice, as monai/smp users do
        p = out.softmax(1)
        onehot = F.one_hot(target, out.shape[1]).movedim(-1, 1).to(p.dtype)
        dice = 1 - (2 * (p * onehot).sum((2, 3)) + 1) / (p.sum((2, 3)) + onehot.sum((2, 3)) + 1)
        return F.cross_entropy(out, target) + dice.mean()
    return F.mse_loss(out, target)  # denoising (noise target), regression, features


def _first(out):
    """The sample of a ``return_dict=False`` tuple, as its users take ``model(...)[0]``."""
    return out[0] if isinstance(out, tuple) else out


class _Lit(pl.LightningModule):
    def __init__(self, net, f):
        super().__init__()
        self.net, self.f = net, f

    def training_step(self, batch, _):
        x, target = batch
        return _task_loss(self.task, _first(self.f(x)), target)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def fit_client(name: str, steps: int = 3, b: int = 2, weight: float = 1e-3) -> dict:
    """``steps`` optimizer steps of a Lightning fit with the regularizer added in one line."""
    client = by_name(name)
    torch.manual_seed(0)
    net = no_dropout(client.build()).train()
    f, (x,), _ = client.call(net, b, torch.float32, torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = _first(f(x))
    if client.task == "classify":
        target = torch.randint(0, out.shape[-1], (steps * b,))
    elif client.task == "segment":
        target = torch.randint(0, out.shape[1], (steps * b, *out.shape[2:]))
    else:
        target = torch.randn(steps * b, *out.shape[1:])
    xs = x.repeat(steps, *[1] * (x.dim() - 1)) + 0.1 * torch.randn(steps * b, *x.shape[1:])
    lit = _Lit(net, f)
    lit.task = client.task
    input_key, output_key = client.fit
    reg = JacobianRegularizer(weight=weight, module="net", reduction="mean", input_key=input_key, output_key=output_key)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, target), batch_size=b)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[reg])
    with sdpa_kernel(SDPBackend.MATH), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lit, loader)
    return {"steps": trainer.global_step, "penalty": reg.last_value,
            "scale_warned": any(issubclass(w.category, PenaltyScaleWarning) for w in caught),
            "capture_warned": [str(w.message) for w in caught if issubclass(w.category, JVPCaptureWarning)]}


@pytest.mark.sweep
@pytest.mark.parametrize("name", [c.name for c in CLIENTS])
def test_client_fit_with_jacobian_regularizer(name):
    got = fit_client(name)
    assert got["steps"] == 3, got
    assert got["scale_warned"] == (name in SCALE_WARNS), got
    assert got["penalty"] is not None and math.isfinite(got["penalty"]) and got["penalty"] > 0, got
    assert got["capture_warned"] == [], got


@pytest.mark.slow
def test_client_fit_warns_when_the_penalty_outweighs_the_task_loss():
    """The same fit with a weight 1e13x larger (its penalty per output element is 2e-5): the weighted penalty is over
    100x the task loss (PenaltyScaleWarning), and the fit still completes."""
    got = fit_client("fno", weight=1e10)
    assert got["steps"] == 3 and got["scale_warned"], got
