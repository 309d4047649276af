"""``python -m jvpreg.bench clients``: real client models as their users call them, and their JVP costs.

The zoo (:data:`CLIENTS`): small configurations with random weights (no download) of models from diffusers, timm,
transformers, torchvision, vit-pytorch, x-transformers, monai, segmentation-models-pytorch and neuraloperator, each
called the way its users call it: the module itself, ``functools.partial(model, **conditioning)`` or a lambda
(``lambda z: model(z, t, class_labels=y).sample``). ``tests/test_clients_zoo.py`` checks every one against
``torch.func.jvp`` in float64; this benchmark times them.

Per model, side by side in one process, interleaved repeats (one call of each method per round) and medians of the
process CPU clock (with one torch thread, the wall time of an idle machine: :func:`jvpreg.bench.report.measure_clocks`):
the plain forward of ``B`` rows and of ``2B`` rows (the physical floor of a one-tangent clone JVP),
``jvpreg.jvp`` on the call form its users write with the default engine (``"auto"``: eager on a signature's first
call, captured from its second; the timed calls are steady state), ``torch.func.jvp`` and
``torch.autograd.functional.jvp`` (double backward), all without gradients kept except the double backward's.
Ratios: jvpreg / forward_2B and torch.func / jvpreg; the geometric mean of jvpreg / forward_2B over the models.
The mean-flow row is a DiT's JVP in ``(z, t, r)`` with tangents ``(v, 1, 0)`` (mean-flow training's ``u``-target).
The engine column says what the default engine ran on the timed calls (captured program or eager).
Libraries are imported by the builders only: the package does not depend on them (``pip install jvpreg[clients]``).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

import jvpreg
from jvpreg.bench.report import (command_line, describe_git, fmt_ratio, geo_mean, git_state, md_table, steady_malloc,
                                 write_results)
from jvpreg.bench.timing import machine_description
from jvpreg.clone import JVPCaptureWarning
from jvpreg.clone.program.capture import programs

__all__ = ["Client", "CLIENTS", "by_name", "to_dtype", "no_dropout", "engine_used", "main"]


def to_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with real floating tensors in ``dtype`` and complex ones in its complex counterpart (``Module.double``
    leaves FNO's complex spectral weights in complex64; ``Module.to(float64)`` drops their imaginary part)."""
    cdtype = {torch.float64: torch.complex128, torch.float32: torch.complex64}[dtype]
    return model._apply(lambda t: t.to(cdtype) if t.is_complex() else (t.to(dtype) if t.is_floating_point() else t))


def no_dropout(model: nn.Module) -> nn.Module:
    """Every dropout's ``p`` set to 0 (train mode without randomness: comparable to a reference)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return model


@dataclass
class Client:
    """One zoo entry.

    ``build()``: the model (float32, random weights, eval mode). ``call(model, b, dtype, gen)``: ``(func, primals,
    tangents)`` as its users write the JVP on ``b`` rows (``func`` is the module, a partial or a lambda; conditioning
    tensors drawn from ``gen`` live in its closure). ``task``: what a training step scores (``"denoise"``,
    ``"classify"``, ``"segment"``, ``"regress"``, ``"features"``). ``fit``: ``(input_key, output_key)`` for
    :class:`jvpreg.callbacks.JacobianRegularizer` (``None``: the module's first argument / its tensor output).
    ``train_reference``: how train mode is checked: ``"torch.func"`` or ``"double_backward"`` (torch.func refuses
    train-mode BatchNorm's in-place running statistics)."""

    name: str
    library: str
    form: str
    build: Callable[[], nn.Module]
    call: Callable[..., Tuple[Callable, Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]]
    task: str = "features"
    fit: Tuple[Optional[str], Optional[str]] = (None, None)
    train_reference: str = "torch.func"
    tol: float = 1e-9
    slow: bool = False
    notes: str = ""


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _pair(gen, *shape, dtype):
    return (_randn(gen, *shape, dtype=dtype),), (_randn(gen, *shape, dtype=dtype),)


def _image_module(size=32, ch=3):
    def call(model, b, dtype, gen):
        x, u = _pair(gen, b, ch, size, size, dtype=dtype)
        return model, x, u
    return call


# --------------------------------------------------------------------------- diffusers

def _dit():
    from diffusers import DiTTransformer2DModel
    return DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2,
                                 norm_num_groups=4, sample_size=8, patch_size=2, num_embeds_ada_norm=10)


def _dit_lambda(model, b, dtype, gen):
    t = torch.randint(0, 1000, (b,), generator=gen)
    y = torch.randint(0, 10, (b,), generator=gen)
    z, v = _pair(gen, b, 4, 8, 8, dtype=dtype)
    return (lambda z: model(z, timestep=t, class_labels=y).sample), z, v


def _unet2d():
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4, attention_head_dim=8)


def _unet2d_partial(model, b, dtype, gen):
    t = torch.randint(0, 1000, (b,), generator=gen)
    z, v = _pair(gen, b, 3, 16, 16, dtype=dtype)
    return functools.partial(model, timestep=t, return_dict=False), z, v


def _unet2d_cond():
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=12,
                                attention_head_dim=4, norm_num_groups=4)


def _unet2d_cond_lambda(model, b, dtype, gen):
    t = torch.randint(0, 1000, (b,), generator=gen)
    c = _randn(gen, b, 5, 12, dtype=dtype)
    z, v = _pair(gen, b, 4, 16, 16, dtype=dtype)
    return (lambda z: model(z, t, encoder_hidden_states=c).sample), z, v


def _sd3():
    from diffusers import SD3Transformer2DModel
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=16,
                                 pooled_projection_dim=10, out_channels=4, pos_embed_max_size=8)


def _sd3_partial(model, b, dtype, gen):
    c = _randn(gen, b, 5, 12, dtype=dtype)
    p = _randn(gen, b, 10, dtype=dtype)
    t = torch.randint(0, 1000, (b,), generator=gen)
    z, v = _pair(gen, b, 4, 8, 8, dtype=dtype)
    return functools.partial(model, encoder_hidden_states=c, pooled_projections=p, timestep=t, return_dict=False), z, v


def _flux():
    from diffusers import FluxTransformer2DModel
    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=12,
                                  pooled_projection_dim=10, guidance_embeds=False, axes_dims_rope=(2, 2, 4))


def _flux_lambda(model, b, dtype, gen):
    n, m = 16, 5
    c = _randn(gen, b, m, 12, dtype=dtype)
    p = _randn(gen, b, 10, dtype=dtype)
    t = torch.rand(b, generator=gen).to(dtype)
    img_ids = torch.zeros(n, 3, dtype=dtype)
    img_ids[:, 1], img_ids[:, 2] = torch.arange(n) // 4, torch.arange(n) % 4
    txt_ids = torch.zeros(m, 3, dtype=dtype)
    z, v = _pair(gen, b, n, 8, dtype=dtype)
    return (lambda z: model(z, encoder_hidden_states=c, pooled_projections=p, timestep=t, img_ids=img_ids,
                            txt_ids=txt_ids).sample), z, v


# --------------------------------------------------------------------------- timm

def _timm(name, **kw):
    def build():
        import timm
        return timm.create_model(name, pretrained=False, **kw)
    return build


# --------------------------------------------------------------------------- transformers

def _hf_vit():
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=64, num_labels=10,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _hf_vit_call(model, b, dtype, gen):
    x, u = _pair(gen, b, 3, 32, 32, dtype=dtype)
    return (lambda x: model(pixel_values=x).logits), x, u


def _bert():
    from transformers import BertConfig, BertModel
    return BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0), add_pooling_layer=False)


def _bert_call(model, b, dtype, gen):
    n = 12
    mask = torch.ones(b, n, dtype=torch.long)
    mask[0, 8:] = 0  # a padded sample: the mask reaches the attention
    e, u = _pair(gen, b, n, 32, dtype=dtype)
    return (lambda e: model(inputs_embeds=e, attention_mask=mask).last_hidden_state), e, u


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _gpt2_lambda(model, b, dtype, gen):
    e, u = _pair(gen, b, 12, 32, dtype=dtype)
    return (lambda e: model(inputs_embeds=e, use_cache=False).logits), e, u


# --------------------------------------------------------------------------- torchvision

def _tv(name, **kw):
    def build():
        import torchvision
        return getattr(torchvision.models, name)(weights=None, **kw)
    return build


def _tv_vit():
    from torchvision.models.vision_transformer import VisionTransformer
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                              num_classes=10)
    nn.init.normal_(model.heads.head.weight, std=0.1)  # zero at init: a zero Jacobian would compare 0 with 0
    return model


# --------------------------------------------------------------------------- vit-pytorch, x-transformers

def _vitpt():
    from vit_pytorch import ViT
    return ViT(image_size=32, patch_size=8, num_classes=10, dim=32, depth=2, heads=2, mlp_dim=64, dim_head=16)


def _simple_vit():
    from vit_pytorch import SimpleViT
    return SimpleViT(image_size=32, patch_size=8, num_classes=10, dim=32, depth=2, heads=2, mlp_dim=64, dim_head=16)


def _xt_encoder():
    from x_transformers import ContinuousTransformerWrapper, Encoder
    return ContinuousTransformerWrapper(dim_in=8, dim_out=8, max_seq_len=16,
                                        attn_layers=Encoder(dim=32, depth=2, heads=2, rotary_pos_emb=True))


def _xt_encoder_partial(model, b, dtype, gen):
    mask = torch.ones(b, 12, dtype=torch.bool)
    mask[0, 9:] = False
    x, u = _pair(gen, b, 12, 8, dtype=dtype)
    return functools.partial(model, mask=mask), x, u


def _xt_decoder():
    from x_transformers import ContinuousTransformerWrapper, Decoder
    return ContinuousTransformerWrapper(dim_in=8, dim_out=8, max_seq_len=16,
                                        attn_layers=Decoder(dim=32, depth=2, heads=2, ff_glu=True))


def _seq_module(n=12, d=8):
    def call(model, b, dtype, gen):
        x, u = _pair(gen, b, n, d, dtype=dtype)
        return model, x, u
    return call


# --------------------------------------------------------------------------- monai, smp, neuraloperator

def _monai_unet():
    from monai.networks.nets import UNet
    return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32), strides=(2, 2), num_res_units=1,
                norm="batch")


def _monai_basic():
    from monai.networks.nets import BasicUNet
    return BasicUNet(spatial_dims=2, in_channels=1, out_channels=2, features=(8, 8, 16, 16, 32, 8))


def _smp_unet():
    import segmentation_models_pytorch as smp
    return smp.Unet(encoder_name="resnet18", encoder_weights=None, in_channels=3, classes=2,
                    decoder_channels=(32, 16, 16, 8, 8))


def _fno():
    from neuralop.models import FNO
    return FNO(n_modes=(4, 4), hidden_channels=8, in_channels=2, out_channels=1, n_layers=2)


CLIENTS: List[Client] = [
    # diffusers
    Client("dit", "diffusers", "lambda", _dit, _dit_lambda, task="denoise", fit=(None, "sample")),
    Client("unet2d", "diffusers", "partial", _unet2d, _unet2d_partial, task="denoise", fit=(None, 0)),
    Client("unet2d_condition", "diffusers", "lambda", _unet2d_cond, _unet2d_cond_lambda, task="denoise",
           fit=(None, "sample")),
    Client("sd3_transformer", "diffusers", "partial", _sd3, _sd3_partial, task="denoise", fit=(None, 0)),
    Client("flux_transformer", "diffusers", "lambda", _flux, _flux_lambda, task="denoise", fit=(None, "sample")),
    # timm
    Client("timm_vit", "timm", "module", _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                                               num_classes=10), _image_module(), task="classify"),
    Client("timm_resnet18", "timm", "module", _timm("resnet18", num_classes=10), _image_module(), task="classify",
           train_reference="double_backward"),
    Client("timm_convnext", "timm", "module", _timm("convnext_atto", num_classes=10), _image_module(),
           task="classify"),
    # transformers
    Client("hf_vit", "transformers", "lambda", _hf_vit, _hf_vit_call, task="classify", fit=("pixel_values", "logits")),
    Client("hf_bert", "transformers", "lambda", _bert, _bert_call, task="features",
           fit=("inputs_embeds", "last_hidden_state")),
    Client("hf_gpt2", "transformers", "lambda", _gpt2, _gpt2_lambda, task="features", fit=("inputs_embeds", "logits")),
    # torchvision
    Client("tv_resnet18", "torchvision", "module", _tv("resnet18", num_classes=10), _image_module(), task="classify",
           train_reference="double_backward"),
    Client("tv_mobilenet_v3", "torchvision", "module", _tv("mobilenet_v3_small", num_classes=10), _image_module(),
           task="classify", train_reference="double_backward"),
    Client("tv_vit", "torchvision", "module", _tv_vit, _image_module(), task="classify"),
    # vit-pytorch
    Client("vitpytorch_vit", "vit-pytorch", "module", _vitpt, _image_module(), task="classify"),
    Client("vitpytorch_simple_vit", "vit-pytorch", "module", _simple_vit, _image_module(), task="classify"),
    # x-transformers
    Client("xt_encoder", "x-transformers", "partial", _xt_encoder, _xt_encoder_partial, task="features"),
    Client("xt_decoder", "x-transformers", "module", _xt_decoder, _seq_module(), task="features"),
    # monai
    Client("monai_unet", "monai", "module", _monai_unet, _image_module(16, 1), task="segment",
           train_reference="double_backward"),
    Client("monai_basicunet", "monai", "module", _monai_basic, _image_module(32, 1), task="segment"),
    # segmentation-models-pytorch
    Client("smp_unet", "segmentation-models-pytorch", "module", _smp_unet, _image_module(32, 3), task="segment",
           train_reference="double_backward"),
    # neuraloperator
    Client("fno", "neuraloperator", "module", _fno, _image_module(16, 2), task="regress", tol=1e-9),
]


def by_name(name: str) -> Client:
    for c in CLIENTS:
        if c.name == name:
            return c
    raise KeyError(f"no client {name!r}; known: {', '.join(c.name for c in CLIENTS)}")


# --------------------------------------------------------------------------- mean flow

def mean_flow_call(model: nn.Module, b: int, dtype: torch.dtype, gen: torch.Generator):
    """A mean-flow JVP on diffusers' DiT: ``u(z, t, r) = model(z, timestep=1000 (t - r), class_labels=y).sample``
    (diffusers' DiT embeds one time: here the interval ``t - r``), primals ``(z, t, r)``, tangents ``(v, 1, 0)``:
    ``d/dt u`` along the flow, mean-flow training's target term."""
    y = torch.randint(0, 10, (b,), generator=gen)
    z, v = _pair(gen, b, 4, 8, 8, dtype=dtype)
    t = torch.rand(b, generator=gen).to(dtype)
    r = t * torch.rand(b, generator=gen).to(dtype)
    f = lambda z, t, r: model(z, timestep=1000 * (t - r), class_labels=y).sample  # noqa: E731
    return f, (z[0], t, r), (v[0], torch.ones_like(t), torch.zeros_like(r))


MEAN_FLOW = Client("dit_mean_flow", "diffusers", "lambda", _dit, mean_flow_call, task="denoise",
                   notes="tangents (v, 1, 0) in (z, t, r)")


# --------------------------------------------------------------------------- engine used

def engine_used(model: nn.Module, before: Dict[Any, int]) -> str:
    """What the default engine ran since ``before`` (:func:`replays`): ``"captured"`` if a program replayed,
    else ``"eager"``."""
    after = replays(model)
    return "captured" if any(after.get(k, 0) > n for k, n in before.items()) or \
        any(k not in before and n > 0 for k, n in after.items()) else "eager"


def replays(model: nn.Module) -> Dict[Any, int]:
    """Replays so far of each captured program of ``model`` (programs that run eagerly left out)."""
    return {k: p.replays for k, p in programs(model).items() if p.gm is not None}


# --------------------------------------------------------------------------- benchmark

METHODS = ("forward_B", "forward_2B", "jvpreg", "torch.func.jvp", "autograd.functional.jvp")


def _methods(client: Client, model: nn.Module, b: int, dtype: torch.dtype, compiled: bool) -> Dict[str, Callable]:
    f, x, u = client.call(model, b, dtype, torch.Generator().manual_seed(1))
    f2, x2, _ = client.call(model, 2 * b, dtype, torch.Generator().manual_seed(1))

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    fns = {
        "forward_B": no_grad(lambda: f(*x)),
        "forward_2B": no_grad(lambda: f2(*x2)),
        "jvpreg": no_grad(lambda: jvpreg.jvp(f, x, u)),  # the default engine, on the call form users write
        "torch.func.jvp": no_grad(lambda: torch.func.jvp(f, x, u)),
        "autograd.functional.jvp": lambda: torch.autograd.functional.jvp(f, x, u),
    }
    if compiled:
        fns["jvpreg_compiled"] = no_grad(lambda: jvpreg.jvp(f, x, u, engine="compiled"))
    return fns


def _tangent(result):
    out = result[1]
    return out[0] if isinstance(out, (tuple, list)) else out


def bench_one(client: Client, b: int, repeats: int, warmup: int, dtype: torch.dtype = torch.float32,
              compiled: bool = False) -> Dict[str, Any]:
    """Interleaved repeats of every method (one call of each per round), CPU-clock medians, and the engine the
    default path ran; every method's tangent checked against jvpreg's once (relative max error)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = to_dtype(no_dropout(client.build()), dtype).eval()
    row: Dict[str, Any] = {"model": client.name, "library": client.library, "form": client.form,
                           "params": sum(p.numel() for p in model.parameters()), "batch": b}
    with sdpa_kernel(SDPBackend.MATH), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", JVPCaptureWarning)
        fns = _methods(client, model, b, dtype, compiled)
        ok, ref = {}, _tangent(fns["jvpreg"]())
        scale = ref.abs().max().item() or 1.0
        row["errors"] = {}
        for name, fn in fns.items():
            try:
                for _ in range(warmup):
                    out = fn()
                if name not in ("forward_B", "forward_2B", "jvpreg"):
                    row["errors"][name] = (_tangent(out) - ref).abs().max().item() / scale
                ok[name] = fn
            except Exception as err:  # recorded, the run goes on (e.g. a library's op without a forward-AD formula)
                row.setdefault("failed", {})[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        before = replays(model)
        times: Dict[str, List[float]] = {n: [] for n in ok}
        for _ in range(repeats):
            for name, fn in ok.items():
                c0 = time.process_time()
                fn()
                times[name].append(time.process_time() - c0)
        row["engine"] = engine_used(model, before)
        row["capture_warnings"] = sorted({str(w.message)[:200] for w in caught
                                          if issubclass(w.category, JVPCaptureWarning)})
    row["median_s"] = {n: statistics.median(v) for n, v in times.items()}
    med = row["median_s"]
    if "jvpreg" in med and "forward_2B" in med:
        row["jvpreg_over_forward_2B"] = med["jvpreg"] / med["forward_2B"]
    if "jvpreg" in med and "torch.func.jvp" in med:
        row["torch_func_over_jvpreg"] = med["torch.func.jvp"] / med["jvpreg"]
    if "jvpreg" in med and "autograd.functional.jvp" in med:
        row["double_backward_over_jvpreg"] = med["autograd.functional.jvp"] / med["jvpreg"]
    return row


def to_markdown(rows: Sequence[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    ms = lambda r, n: f"{1e3 * r['median_s'][n]:.2f}" if n in r.get("median_s", {}) else "fail"  # noqa: E731
    table = md_table(
        ["model", "library", "call", "engine", "fwd B ms", "fwd 2B ms", "jvpreg ms", "torch.func ms",
         "double bwd ms", "jvpreg / fwd 2B", "torch.func / jvpreg", "double bwd / jvpreg"],
        [[r["model"], r["library"], r["form"], r.get("engine", "-"), ms(r, "forward_B"), ms(r, "forward_2B"),
          ms(r, "jvpreg"), ms(r, "torch.func.jvp"), ms(r, "autograd.functional.jvp"),
          fmt_ratio(r.get("jvpreg_over_forward_2B")), fmt_ratio(r.get("torch_func_over_jvpreg")),
          fmt_ratio(r.get("double_backward_over_jvpreg"))] for r in rows], align="lllc" + "r" * 8)
    if any("jvpreg_compiled" in r.get("median_s", {}) for r in rows):  # --compiled
        table += "\n\n" + md_table(["model", "jvpreg compiled ms", "compiled / fwd 2B"],
                                    [[r["model"], ms(r, "jvpreg_compiled"),
                                      fmt_ratio(r["median_s"]["jvpreg_compiled"] / r["median_s"]["forward_2B"])
                                      if "jvpreg_compiled" in r["median_s"] and "forward_2B" in r["median_s"]
                                      else "-"] for r in rows])
    gm = geo_mean(r.get("jvpreg_over_forward_2B") for r in rows)
    gf = geo_mean(r.get("torch_func_over_jvpreg") for r in rows)
    failed = [f"- `{r['model']}` {n}: {e}" for r in rows for n, e in r.get("failed", {}).items()]
    warned = [f"- `{r['model']}`: {w}" for r in rows for w in r.get("capture_warnings", [])]
    m = meta["machine"]
    return "\n".join([
        "# Real client models: jvpreg on the call forms their users write", "",
        f"Command: `{meta['command']}`", "",
        f"Machine: {m['cpu']} ({m['cpu_cores']} cores, shared), torch {m['torch']}, {m['torch_threads']} torch "
        f"thread(s), {meta['dtype']}, batch B = {meta['batch']}, {meta['repeats']} interleaved repeats, medians of "
        f"the process CPU clock; {meta['git']}; engine column: what `jvpreg.jvp`'s default engine ran on the timed "
        "calls. SDPA on its math kernel for every method.", "",
        table, "",
        f"Geometric mean of jvpreg / forward 2B: **{fmt_ratio(gm)}**; of torch.func / jvpreg: **{fmt_ratio(gf)}** "
        f"({len(rows)} models).", "",
        *(["Methods that failed:", "", *failed, ""] if failed else []),
        *(["JVPCaptureWarnings:", "", *warned, ""] if warned else []),
    ])


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m jvpreg.bench clients", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3, help="calls before timing (>= 2: the default engine captures "
                                                          "on a signature's second call)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", nargs="*", default=None, help="names from the zoo (default: all, and the mean flow)")
    p.add_argument("--compiled", action="store_true", help="also time engine='compiled' (slow to compile)")
    p.add_argument("--out", default=None, help="results stem: writes <out>.md and <out>.json")
    args = p.parse_args(argv)
    if args.warmup < 2:
        p.error("--warmup must be >= 2 (the default engine captures on a signature's second call)")
    torch.set_num_threads(args.threads)
    steady_malloc()
    clients = [*CLIENTS, MEAN_FLOW]
    if args.models:
        clients = [c for c in clients if c.name in args.models]
    rows = []
    for c in clients:
        t0 = time.time()
        row = bench_one(c, args.batch, args.repeats, args.warmup, compiled=args.compiled)
        rows.append(row)
        ratio = row.get("jvpreg_over_forward_2B", float("nan"))
        print(f"{c.name:24s} {row.get('engine', '-'):9s} jvpreg/fwd2B {ratio:6.2f} "
              f"torch.func/jvpreg {row.get('torch_func_over_jvpreg', float('nan')):6.2f} ({time.time() - t0:.0f} s)",
              flush=True)
    meta = {"command": command_line("python -m jvpreg.bench clients", argv), "machine": machine_description("cpu"),
            "git": describe_git(git_state()), "dtype": "float32", "batch": args.batch, "repeats": args.repeats}
    md = to_markdown(rows, meta)
    print(md)
    if args.out:
        write_results(args.out, md, {"meta": meta, "rows": rows,
                                     "geo_mean_jvpreg_over_forward_2B": geo_mean(r.get("jvpreg_over_forward_2B")
                                                                                 for r in rows)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
