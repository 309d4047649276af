"""jvpreg.jvp against torch.func.jvp on timm and Hugging Face architectures: random weights, float64, eval mode.

Writes ``docs/model_zoo.md`` and ``.json``: per model, the relative error ``||t - t_ref|| / ||t_ref||`` of the eager
and the captured engine, and of the captured engine on the accelerator's code path
(:func:`jvpreg.clone.core.device_paths.accelerator_path`, with a regularized step's gradients against the host path's),
the ops that took the exact fallback, and why a model could not be captured.

* Input: batch 2 at 64x64 where the architecture takes ``img_size``, else batch 1 at its own input size; Hugging
  Face text models get ``inputs_embeds`` (batch 2, 10 tokens, the second sample's last 3 padded out by the
  attention mask: the ``-inf``/``finfo.min`` masking path).
* Reference: ``torch.func.jvp`` of the same model. Where forward AD is missing (the fused attention kernels), the
  same model with ``scaled_dot_product_attention`` on its math backend; where that fails too, the same weights with
  attention on its math path (timm: ``fused_attn = False``; Hugging Face: ``attn_implementation="eager"``, whose
  masking can differ: ModernBERT's eager attention gives NaN on a padded query whose local window is all padding,
  where SDPA's gives a finite row).
* Verdict, in *float64 throughout*: many models compute parts of themselves in float32 whatever the input dtype
  (LLaMA's RMSNorm, ``softmax(dtype=float32)``, EvoNorm, EfficientViT's attention), so there both results are
  float32-accurate and differ by ~1e-8. The verdict compares them with those casts turned into no-ops (ours and
  the reference alike), and with torch's ``hardsigmoid`` replaced by ``relu6(x + 3) / 6`` in the reference only:
  torch's backward kernel for it uses a float32 1/6 (3e-8 relative error in float64). ``exact``: both engines
  within 1e-10 there. The errors of the model as it is are in the table too.

Usage::

    python scripts/model_zoo_sweep.py                       # the default lists below (~2 hours on 2 CPU cores)
    python scripts/model_zoo_sweep.py --timm resnet18,convnext_atto --hf llama --out /tmp/zoo

Each model runs in its own subprocess (``--one timm NAME`` prints its JSON), so a crash or a timeout is one row.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

TIMM = ("test_vit test_vit4 test_convnext test_efficientnet test_efficientnet_evos test_nfnet test_byobnet test_resnet "
        "test_coatnet test_mambaout resnet10t resnet18d seresnext26t_32x4d skresnet18 resnest14d res2net50_26w_4s "
        "regnetx_002 dla34 densenet121 dpn48b hrnet_w18_small cspnext_tiny ese_vovnet19b_slim_dw mobilenetv3_small_050 "
        "mobilenetv4_conv_small mobilenetv2_050 efficientnet_lite0 tf_efficientnet_b0 mixnet_s ghostnet_050 "
        "hardcorenas_b fbnetv3_b lcnet_050 rexnet_100 repvit_m1 mobileone_s0 convnext_atto convnextv2_atto "
        "edgenext_xx_small inception_next_atto poolformerv2_s12 convmixer_768_32 mobilevit_xxs mobilevitv2_050 "
        "efficientformerv2_s0 efficientvit_b0 efficientvit_m0 fastvit_t8 deit_tiny_patch16_224 cait_xxs24_224 "
        "xcit_nano_12_p8_224 pit_ti_224 levit_128s crossvit_tiny_240 coat_tiny convit_tiny tiny_vit_5m_224 "
        "swin_tiny_patch4_window7_224 maxvit_nano_rw_256 davit_tiny focalnet_tiny_srf gcvit_xxtiny hiera_tiny_224 "
        "eva02_tiny_patch14_224 mixer_s32_224 gmixer_12_224 resmlp_12_224 sequencer2d_s").split()
HF = ("bert roberta distilbert electra mpnet gpt2 gpt_neox opt phi falcon llama mistral qwen2 qwen3 gemma gemma2 "
      "t5 bart mixtral qwen2_moe modernbert hf_vit hf_swin hf_convnext hf_dinov2").split()
MOE = ("mixtral", "qwen2_moe")
EXACT = 1e-10


# --------------------------------------------------------------------------------------------- one model


def _rel(a, b) -> float:
    import torch

    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@contextlib.contextmanager
def float64_throughout():
    """Float32 casts of float64 tensors (``.float()``, ``.to(torch.float32)``, ``softmax(dtype=float32)``) as no-ops."""
    import torch
    import torch.nn.functional as F

    to, flt, softmax = torch.Tensor.to, torch.Tensor.float, F.softmax

    def to64(self, *args, **kwargs):
        if self.dtype == torch.float64 and (any(a is torch.float32 for a in args) or kwargs.get("dtype") is torch.float32):
            return self
        return to(self, *args, **kwargs)

    def softmax64(input, dim=None, _stacklevel=3, dtype=None):
        return softmax(input, dim=dim, dtype=None if input.dtype == torch.float64 else dtype)

    torch.Tensor.to, torch.Tensor.float, F.softmax = to64, (lambda self: flt(self) if self.dtype != torch.float64
                                                             else self), softmax64
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, F.softmax = to, flt, softmax


@contextlib.contextmanager
def exact_hardsigmoid():
    """``F.hardsigmoid`` as ``relu6(x + 3) / 6``: torch's kernel gives a float32-accurate derivative in float64."""
    import torch.nn.functional as F

    hs = F.hardsigmoid
    F.hardsigmoid = lambda input, inplace=False: F.relu6(input + 3) / 6
    try:
        yield
    finally:
        F.hardsigmoid = hs


def _timm(name: str):
    import timm
    import torch

    last = None
    for size in (64, None):
        try:
            model = timm.create_model(name, pretrained=False, num_classes=5, **({"img_size": size} if size else {}))
            c = model.pretrained_cfg.get("input_size", (3, 224, 224))
            shape = (2, c[0], size, size) if size else (1, *c)
            model = model.double().eval()
            x = torch.randn(shape, dtype=torch.float64)
            with torch.no_grad():
                model(x)
            break
        except Exception as err:  # noqa: BLE001  (an architecture without img_size or with a fixed size)
            last = err
    else:
        raise last

    def math_attention(m):
        m = copy.deepcopy(m)
        for sub in m.modules():
            if getattr(sub, "fused_attn", None) is True:
                sub.fused_attn = False
        return m

    return model, (lambda m: m), x, math_attention


_H, _LAYERS, _HEADS, _FF = 32, 2, 4, 64


def _hf_config(name: str):
    import transformers as T

    dims = dict(hidden_size=_H, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS, intermediate_size=_FF)
    gqa = dict(dims, num_key_value_heads=2)
    text = {
        "bert": (T.BertConfig, dims), "roberta": (T.RobertaConfig, dims), "electra": (T.ElectraConfig, dict(dims, embedding_size=_H)),
        "mpnet": (T.MPNetConfig, dims), "gpt_neox": (T.GPTNeoXConfig, dims), "phi": (T.PhiConfig, dims),
        "falcon": (T.FalconConfig, dict(hidden_size=_H, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS)),
        "distilbert": (T.DistilBertConfig, dict(dim=_H, n_layers=_LAYERS, n_heads=_HEADS, hidden_dim=_FF)),
        "gpt2": (T.GPT2Config, dict(n_embd=_H, n_layer=_LAYERS, n_head=_HEADS, n_positions=64)),
        "opt": (T.OPTConfig, dict(hidden_size=_H, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS, ffn_dim=_FF,
                                  word_embed_proj_dim=_H)),
        "llama": (T.LlamaConfig, gqa), "mistral": (T.MistralConfig, gqa), "qwen2": (T.Qwen2Config, gqa),
        "qwen3": (T.Qwen3Config, dict(gqa, head_dim=8)), "gemma": (T.GemmaConfig, dict(gqa, head_dim=8)),
        "gemma2": (T.Gemma2Config, dict(gqa, head_dim=8)),
        "modernbert": (T.ModernBertConfig, dict(dims, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                                sep_token_id=2, global_attn_every_n_layers=2, local_attention=4)),
        "mixtral": (T.MixtralConfig, dict(gqa, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": (T.Qwen2MoeConfig, dict(gqa, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=16)),
        "t5": (T.T5Config, dict(d_model=_H, d_kv=8, d_ff=_FF, num_layers=_LAYERS, num_heads=_HEADS)),
        "bart": (T.BartConfig, dict(d_model=_H, encoder_layers=_LAYERS, decoder_layers=_LAYERS, encoder_ffn_dim=_FF,
                                    decoder_ffn_dim=_FF, encoder_attention_heads=_HEADS,
                                    decoder_attention_heads=_HEADS)),
    }
    vision = {
        "hf_vit": (T.ViTConfig, dict(dims, image_size=32, patch_size=8)),
        "hf_dinov2": (T.Dinov2Config, dict(dims, image_size=32, patch_size=8)),
        "hf_swin": (T.SwinConfig, dict(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                       window_size=4)),
        "hf_convnext": (T.ConvNextConfig, dict(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1])),
    }
    if name in text:
        cls, kw = text[name]
        return cls(vocab_size=100, max_position_embeddings=64, **kw), "text"
    cls, kw = vision[name]
    return cls(**kw), "vision"


class _LastHidden:
    """``x -> model(inputs_embeds=x, attention_mask=mask).last_hidden_state`` (``pixel_values=x`` without a mask)
    as a module, so that the captured engine records it."""

    def __new__(cls, model, mask):
        from torch import nn

        class LastHidden(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model
                self.mask = mask

            def forward(self, x):
                if self.mask is None:
                    return self.model(pixel_values=x).last_hidden_state
                return self.model(inputs_embeds=x, attention_mask=self.mask).last_hidden_state

        return LastHidden()


def _hf(name: str):
    import torch
    import transformers as T

    cfg, kind = _hf_config(name)
    # Mixture-of-Experts: the experts one by one (torch's CPU grouped_mm, their default, takes no float64; the
    # rule for it is checked in float32 by tests/clone/test_grouped_mm.py)
    experts = {"experts_implementation": "eager"} if name in MOE else {}
    try:
        model = T.AutoModel.from_config(cfg, attn_implementation="sdpa", **experts)
    except (ValueError, ImportError):  # no SDPA path in this architecture: its eager attention is the model
        model = T.AutoModel.from_config(cfg, attn_implementation="eager", **experts)
    model = model.double().eval()
    if kind == "text":
        x = torch.randn(2, 10, _H, dtype=torch.float64)
        mask = torch.ones(2, 10, dtype=torch.long)
        mask[1, -3:] = 0
    else:
        x, mask = torch.randn(2, 3, 32, 32, dtype=torch.float64), None

    def call(m):
        return _LastHidden(m.get_encoder() if name in ("t5", "bart") else m, mask)

    def math_attention(m):
        ref = T.AutoModel.from_config(copy.deepcopy(cfg), attn_implementation="eager", **experts).double().eval()  # not
        # the model's own config: from_config writes the attention implementation into it
        ref.load_state_dict(m.state_dict())
        return ref

    return model, call, x, math_attention


def check_one(source: str, name: str) -> dict:
    """One model: errors of both engines against the reference, as it is and in float64 throughout."""
    import torch

    import jvpreg
    from jvpreg.clone.core.device_paths import accelerator_path

    torch.manual_seed(0)
    row = {"source": source, "model": name}
    model, call, x, math_attention = (_timm if source == "timm" else _hf)(name)
    row["input"] = "x".join(map(str, x.shape))
    u = torch.randn_like(x)

    def reference():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            return torch.func.jvp(call(model), (x,), (u,))[1], "torch.func.jvp"
        except (NotImplementedError, RuntimeError):
            pass
        try:  # the same model, its scaled_dot_product_attention on the math backend (it has forward AD)
            with sdpa_kernel(SDPBackend.MATH):
                return torch.func.jvp(call(model), (x,), (u,))[1], "torch.func.jvp, math SDPA backend"
        except (NotImplementedError, RuntimeError):
            return torch.func.jvp(call(math_attention(model)), (x,), (u,))[1], "torch.func.jvp, math attention"

    t_ref, row["reference"] = reference()
    fallbacks, capture_reason = set(), ""
    results = {}
    for engine in ("eager", "captured"):
        f = call(model)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            start = time.perf_counter()
            results[engine] = jvpreg.jvp(f, (x,), (u,), engine=engine)[1]
            row[f"first_call_s_{engine}"] = round(time.perf_counter() - start, 3)
        for w in seen:
            text = str(w.message)
            if text.startswith("jvpreg: no clone rule for "):
                fallbacks.add(text[len("jvpreg: no clone rule for "):].split(";")[0])
            elif "cannot be captured" in text:
                capture_reason = text.split("because it cannot be captured: ")[-1].split(". Pass engine")[0]
        row[f"error_{engine}"] = _rel(results[engine], t_ref)
    with float64_throughout():
        with exact_hardsigmoid():
            t64, _ = reference()
        for engine in ("eager", "captured"):
            f = call(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row[f"error64_{engine}"] = _rel(jvpreg.jvp(f, (x,), (u,), engine=engine)[1], t64)
        with accelerator_path(), warnings.catch_warnings():  # the program a GPU replays: a capture, then a replay
            warnings.simplefilter("ignore")
            f = call(model)
            jvpreg.jvp(f, (x,), (u,), engine="captured")
            row["error64_accelerator"] = _rel(jvpreg.jvp(f, (x,), (u,), engine="captured")[1], t64)
    row["fallback_ops"] = sorted(fallbacks)
    row["not_captured"] = capture_reason
    row["host_reads"] = host_reads(model, call, x)
    row["checkpointing"], row["error64_checkpointing"] = checkpointing(source, model, call, x)
    row["error64_accelerator_step"] = accelerator_step(model, call, x)
    exact = max(row["error64_eager"], row["error64_captured"], row["error64_accelerator"],
                row["error64_accelerator_step"], row["error64_checkpointing"] or 0.0) <= EXACT
    row["verdict"] = "exact" if exact else "MISMATCH"
    return row


def host_reads(model, call, x) -> str:
    """What reads a tensor's value on the host in a JVP of this model (on a GPU: a synchronisation), found on the
    ``meta`` device, where every value read raises: ``"none"``; ``"the model's own forward"`` (a plain forward reads
    one: the JVP was not tried); ``"jvpreg (engine): where: error"``; or why the model does not run on ``meta``."""
    import traceback

    import torch

    import jvpreg

    m = call(copy.deepcopy(model).float().to("meta"))
    if getattr(m, "mask", None) is not None:  # _LastHidden's attention mask
        m.mask = m.mask.to("meta")
    xm = torch.zeros(x.shape, device="meta")

    def read(err: Exception) -> bool:
        return "meta tensors" in str(err)

    try:
        with torch.no_grad():
            m(xm)
    except Exception as err:  # noqa: BLE001  (recorded)
        return "the model's own forward" if read(err) else f"does not run on meta: {type(err).__name__}"
    for engine in ("eager", "captured"):
        try:
            for _ in range(2):  # the captured engine: the capture, then a replay
                jvpreg.jvp(m, (xm,), (torch.zeros_like(xm),), engine=engine)
        except Exception as err:  # noqa: BLE001  (recorded)
            frames = [f for f in traceback.extract_tb(err.__traceback__) if "/jvpreg/" in f.filename]
            where = f"{frames[-1].filename.split('/jvpreg/')[-1]}:{frames[-1].lineno}" if frames else "?"
            return f"jvpreg ({engine}): {where}: {type(err).__name__}: {str(err).splitlines()[0][:100]}"
    return "none"


def _without_randomness(model):
    """A train-mode copy with dropout modules and stochastic depth (timm's and HF's ``drop_prob``) off."""
    import torch

    model = copy.deepcopy(model).train()
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
        if isinstance(getattr(mod, "drop_prob", None), float):
            mod.drop_prob = 0.0
    return model


def _regularized_grads(f, x, engine: str) -> dict:
    """Gradients of two train-mode steps (task loss + Jacobian + weight-sensitivity penalties), each from seed 0."""
    import torch

    from jvpreg.losses import JacobianFrobenius, ParameterSensitivity, Stack, regularized_forward

    for _ in range(2):  # the captured engine: the capture, then a replay
        torch.manual_seed(0)
        f.zero_grad()
        penalty = Stack([JacobianFrobenius(seed=0), ParameterSensitivity(params=("*weight",), seed=1)])
        out, pen = regularized_forward(f, x, penalty, engine=engine)
        (out.square().mean() + pen).backward()
    return {n: p.grad for n, p in f.named_parameters() if p.grad is not None}


def accelerator_step(model, call, x) -> float:
    """A regularized training step of the captured engine on the accelerator's path
    (:func:`jvpreg.clone.core.device_paths.accelerator_path`: scales as kernels, non-finite fixes kept, BatchNorm's device
    forms) against the same step on the host's path, in float64: the largest gradient difference over the largest
    gradient (``inf`` if the gradients are of other parameters or the step fails on one path only)."""
    from jvpreg.clone.core.device_paths import accelerator_path

    x = _two_samples(x)
    grads = []
    for path in (contextlib.nullcontext, accelerator_path):
        with path(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                grads.append(_regularized_grads(call(_without_randomness(model)), x, "captured"))
            except Exception as err:  # noqa: BLE001  (recorded: the same error on both paths is the model's)
                grads.append(f"{type(err).__name__}: {err}")
    host, acc = grads
    if isinstance(host, str) or isinstance(acc, str):
        return 0.0 if host == acc else float("inf")
    if host.keys() != acc.keys():
        return float("inf")
    scale = max(float(g.abs().max()) for g in host.values()) or 1.0
    return max(float((acc[n] - host[n]).abs().max()) for n in host) / scale


def _two_samples(x):
    """``[x; -x]`` for a one-sample image input: train-mode BatchNorm needs two samples where it pools to 1x1 (SK
    attention, split attention)."""
    import torch

    return torch.cat([x, -x]) if x.is_floating_point() and x.shape[0] == 1 else x


def checkpointing(source: str, model, call, x) -> tuple:
    """A regularized training step (train mode, dropout modules and stochastic depth off, ``JacobianFrobenius`` + ``ParameterSensitivity`` on every
    weight) with the model's own activation checkpointing on (timm ``set_grad_checkpointing``, Hugging Face
    ``gradient_checkpointing_enable``), eager and captured engines, each against its own step without it, in float64:
    ``(what ran, the largest gradient difference over the largest gradient)``; ``(why not, None)`` where the model
    has no checkpointing, or where its plain forward with checkpointing already differs from the one without (or fails;
    a one-sample image input is doubled, ``[x; -x]``, for train-mode BatchNorm). Every
    step draws from the same seed: stochastic depth and functional dropout made Swin, FocalNet, GhostNet and HF Swin
    differ by 0.08-0.8 before."""
    import torch

    base = _without_randomness(model)
    checkpointed = copy.deepcopy(base)
    try:
        if source == "timm":
            checkpointed.set_grad_checkpointing(True)
        else:
            checkpointed.gradient_checkpointing_enable()
    except Exception as err:  # noqa: BLE001  (recorded: the architecture has none)
        return f"no checkpointing in the model ({type(err).__name__})", None
    x = _two_samples(x)
    with torch.no_grad():  # a model whose checkpointed path computes something else is not jvpreg's to compare
        outs = []
        for m in (base, checkpointed):
            torch.manual_seed(0)  # the same draws for functional dropout (timm's F.dropout(p=drop_rate))
            try:
                outs.append(call(copy.deepcopy(m))(x))
            except Exception as err:  # noqa: BLE001  (recorded)
                return f"the model's plain train-mode forward fails ({type(err).__name__}): not compared", None
        diff = float((outs[0] - outs[1]).abs().max())
    if diff > 1e-10:
        return f"the model's checkpointed forward differs from its plain one (max abs {diff:.1e}): not compared", None

    def grads(m, engine):
        f = call(m)
        return _regularized_grads(f, x, engine), f

    worst, notes = 0.0, []
    for engine in ("eager", "captured"):  # each against its own step without checkpointing (HF's float32 norms
        want, _ = grads(base, engine)     # make the two engines agree only to float32 rounding)
        scale = max(float(g.abs().max()) for g in want.values()) or 1.0
        try:
            got, f = grads(checkpointed, engine)
        except Exception as err:  # noqa: BLE001  (recorded)
            return f"error ({engine}): {type(err).__name__}: {str(err).splitlines()[0][:100]}", float("inf")
        if got.keys() != want.keys():
            return f"gradients of other parameters ({engine})", float("inf")
        worst = max(worst, max(float((got[n] - want[n]).abs().max()) for n in want) / scale)
        if engine == "captured":
            notes.append(_captured_regions(f))
    return f"regularized step, eager and captured ({'; '.join(notes)})", worst


def _captured_regions(f) -> str:
    """How the captured engine ran a checkpointed model: the regions its programs replay through checkpoint, or why
    it ran eagerly."""
    from jvpreg.clone.program import capture
    from jvpreg.clone.program.checkpointed_regions import CheckpointedRegion

    progs = list(capture.programs(f).values())
    reasons = sorted({p.reason for p in progs if p.gm is None})
    if reasons:
        return "eager: " + reasons[0][:80]
    regions = sum(isinstance(m, CheckpointedRegion) for p in progs for m in p.gm.children())
    return f"{regions} checkpointed region{'' if regions == 1 else 's'} replayed"


# --------------------------------------------------------------------------------------------- the sweep


def run(models: list, timeout: float) -> list:
    rows = []
    for i, (source, name) in enumerate(models, 1):
        start = time.time()
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", source, name], capture_output=True, text=True,
                                  timeout=timeout)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
            if lines:
                row = json.loads(lines[-1])
            else:
                err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                row = {"source": source, "model": name, "verdict": "error", "error": err[:300]}
        except subprocess.TimeoutExpired:
            row = {"source": source, "model": name, "verdict": "error", "error": f"timed out after {timeout:.0f} s"}
        rows.append(row)
        print(f"[{i}/{len(models)}] {source} {name}: {row['verdict']} ({time.time() - start:.0f} s)", file=sys.stderr,
              flush=True)
    return rows


def _e(v) -> str:
    return "" if v is None else f"{v:.1e}"


def _checkpointing_cell(r: dict) -> str:
    err = r.get("error64_checkpointing")
    return r.get("checkpointing", "") if err is None else f"{_e(err)} ({r.get('checkpointing', '')})"


def to_markdown(rows: list, command: str) -> str:
    import torch

    counts = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    lines = [
        "# jvpreg.jvp on timm and Hugging Face architectures", "",
        "Relative error `||t - t_ref|| / ||t_ref||` of the JVP in float64, random weights, eval mode; how the "
        "input, the reference and the verdict are chosen: `scripts/model_zoo_sweep.py`. *as is*: the model as "
        "written; *float64 throughout*: its float32 casts turned into no-ops and the reference's hardsigmoid "
        "exact (the verdict: exact within 1e-10). *first call*: seconds, eager vs captured (the capture included). "
        "*host reads*: what reads a tensor's value on the host during a JVP (on a GPU, a synchronisation), found "
        "on the meta device, where every read raises; *the model's own forward* reads values in a plain forward "
        "too (Hugging Face's attention-mask checks). *checkpointing*: a regularized training step (train mode, "
        "Jacobian + weight-sensitivity penalties) with the model's own activation checkpointing on, on the eager and "
        "the captured engine, each against its own step without it: the largest gradient difference over the largest "
        "gradient (part of the verdict), and how many checkpointed regions the captured programs replay through "
        "`torch.utils.checkpoint` (or why that engine ran eagerly). *accelerator path*: the captured engine on the "
        "code path a GPU takes (`jvpreg.clone.core.device_paths.accelerator_path`: scales chosen by kernels in the "
        "program, no value read by the host, the non-finite fixes kept where an infinity can reach, BatchNorm's "
        "device forms), run on the CPU: the JVP's error in float64 throughout, and a regularized training step's "
        "largest gradient difference from the host path's over the largest gradient (both part of the verdict).",
        "", f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {platform.system()}, torch {torch.__version__}, CPU.  ",
        "Verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".", "",
        "| source | model | input | reference | eager (as is) | captured (as is) | eager (f64) | captured (f64) "
        "| accelerator path (f64) | accelerator path, step | verdict | first call eager / captured (s) "
        "| ops on the fallback | not captured because | host reads | checkpointing |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|---|---|---|",
    ]
    for r in rows:
        if r["verdict"] == "error":
            lines.append(f"| {r['source']} | `{r['model']}` | | | | | | | | | error | | | {r.get('error', '')} | | |")
            continue
        lines.append(
            f"| {r['source']} | `{r['model']}` | {r['input']} | {r['reference']} | {_e(r['error_eager'])} | "
            f"{_e(r['error_captured'])} | {_e(r['error64_eager'])} | {_e(r['error64_captured'])} | "
            f"{_e(r.get('error64_accelerator'))} | {_e(r.get('error64_accelerator_step'))} | {r['verdict']} | "
            f"{r['first_call_s_eager']} / {r['first_call_s_captured']} | {', '.join(r['fallback_ops'])} | "
            f"{r['not_captured']} | {r.get('host_reads', '')} | {_checkpointing_cell(r)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timm", default=",".join(TIMM), help="comma-separated timm model names ('' for none)")
    ap.add_argument("--hf", default=",".join(HF), help=f"comma-separated Hugging Face configs from: {', '.join(HF)}")
    ap.add_argument("--out", default="docs/model_zoo", help="output path without extension (.md and .json)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per model")
    ap.add_argument("--one", nargs=2, metavar=("SOURCE", "NAME"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        warnings.filterwarnings("ignore")
        import torch

        torch.set_num_threads(1)
        print(json.dumps(check_one(*args.one)))
        return 0
    unknown = [n for n in filter(None, args.hf.split(",")) if n not in HF]
    if unknown:
        ap.error(f"--hf: unknown config(s) {unknown}; choose from {', '.join(HF)}")
    models = [("timm", n) for n in filter(None, args.timm.split(","))] + \
             [("hf", n) for n in filter(None, args.hf.split(","))]
    rows = run(models, args.timeout)
    command = "python scripts/model_zoo_sweep.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(to_markdown(rows, command))
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    print(f"wrote {out.with_suffix('.md')}: " + ", ".join(f"{r['model']} {r['verdict']}" for r in rows
                                                         if r["verdict"] != "exact"), file=sys.stderr)
    return 0 if all(r["verdict"] == "exact" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
