"""Mixed precision as CUDA's autocast does it, emulated on this CPU.

CUDA's autocast runs softmax, log_softmax, layer_norm, group_norm, exp, log, rsqrt, softplus, logsumexp, cumsum,
pow and sum in float32 and its matrix products in bfloat16; the CPU's keeps all of them in bfloat16. So on a GPU a
rule meets a float32 output next to a bfloat16 tangent, which the CPU never shows: on an H100 (torch 2.11) every bf16 autocast ViT failed with "expected input and grad types to
match" from ``_softmax_backward_data``. The fixture registers CUDA's float32 policy for those ops as the
``AutocastCPU`` kernels (removed after the test). References: the same model in float64 without autocast, with a
bfloat16 tolerance, and the plain forward under the same policy (the primal block: that forward's output and dtype).
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvpreg
from jvpreg.clone.core.device_paths import accelerator_path

_FLOAT32_OPS = ("softmax.int", "log_softmax.int", "layer_norm", "group_norm", "exp", "log", "rsqrt", "softplus",
                "logsumexp", "cumsum", "pow.Tensor_Scalar", "sum", "sum.dim_IntList")  # CUDA's autocast: float32


def _in_float32(op):
    def kernel(*args):
        args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return op(*args)
    return kernel


@pytest.fixture
def cuda_autocast_policy():
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # (overriding a registered kernel warns)
        warnings.simplefilter("ignore")
        for name in _FLOAT32_OPS:
            packet, _, overload = name.partition(".")
            lib.impl(name, _in_float32(getattr(getattr(torch.ops.aten, packet), overload or "default")), "AutocastCPU")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(torch.randn(2, 3, dtype=torch.bfloat16), -1).dtype == torch.float32
    yield
    lib._destroy()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU's own policy is back
        assert torch.softmax(torch.randn(2, 3, dtype=torch.bfloat16), -1).dtype == torch.bfloat16


class Attention(nn.Module):
    """Softmax attention written out (the engine's attention pattern), LayerNorm, GELU."""

    def __init__(self, e=16):
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(e), nn.Linear(e, 3 * e), nn.Linear(e, e)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        p = (q @ k.transpose(-1, -2) / 4).softmax(-1)
        return F.gelu(self.out(p @ v)).log_softmax(-1)


class ConvGroupNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3))).softmax(-1)


class Elementwise(nn.Module):
    """Smooth ops that CUDA's autocast runs in float32, between bfloat16 matrix products (an RMSNorm among them)."""

    def __init__(self, e=8):
        super().__init__()
        self.a, self.b = nn.Linear(e, e), nn.Linear(e, e)

    def forward(self, x):
        h = self.a(x)
        h = h * (h.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
        h = self.b(F.softplus(h) + (h.abs() + 1).log() + (-h.abs()).exp())
        return torch.cat([h.cumsum(-1), h.logsumexp(-1, keepdim=True), h.sum(-1, keepdim=True)], -1)


MODELS = {
    "elementwise": (Elementwise, (4, 8)),
    "attention": (Attention, (2, 5, 16)),
    "transformer_layer": (lambda: nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), (2, 5, 16)),
    "conv_groupnorm": (ConvGroupNorm, (2, 3, 8, 8)),
}


@pytest.mark.parametrize("path", ["host", "accelerator"])
@pytest.mark.parametrize("engine", ["eager", pytest.param("captured", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_autocast_jvp_and_its_gradients_under_cuda_policy(name, engine, path, cuda_autocast_policy):
    """On the host's path and on the accelerator's (:func:`jvpreg.clone.core.device_paths.accelerator_path`), which a GPU
    takes with this policy."""
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().train()  # (train mode: TransformerEncoderLayer's fused fast path is for inference only)
    x, u = torch.randn(shape), torch.randn(shape)
    taken = accelerator_path() if path == "accelerator" else contextlib.nullcontext()
    with torch.autocast("cpu", dtype=torch.bfloat16), taken:
        plain = model(x)
        for _ in range(2):  # the captured engine records on its first call and replays on its second
            out, t = jvpreg.jvp(model, (x,), (u,), engine=engine)
    assert out.dtype == t.dtype == plain.dtype
    torch.testing.assert_close(out, plain, rtol=2e-2, atol=1e-2)  # (the engine's attention rounds differently)
    t.float().square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)

    ref_model = make().double()
    ref_model.load_state_dict(model.state_dict())
    with sdpa_kernel(SDPBackend.MATH):  # (torch.func has no forward AD of the fused CPU kernel)
        _, want = torch.func.jvp(ref_model, (x.double(),), (u.double(),))
    assert ((t.double() - want).norm() / want.norm()).item() < 3e-2  # bfloat16: 8 bits of mantissa
