"""Regularizer callbacks on the models people use: Hugging Face (keyword inputs, ``ModelOutput``, a loss
computed inside ``forward``), dict batches, several regularizers of one class, the progress bar, and the
messages for what does not fit (a wrong ``input_key``, integer inputs, a ``torch.compile``d network)."""
from __future__ import annotations

import collections
import copy
import os
import warnings

os.environ.setdefault("WANDB_MODE", "disabled")

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from jvpreg.callbacks import JacobianRegularizer, JVPRegularizer, SpectralRegularizer, TangentPropRegularizer
from jvpreg.clone import JVPFallbackWarning
from jvpreg.losses import JacobianFrobenius

from test_callbacks import GradCapture, Lit, data, make_trainer, mlp_dropout, twin_u

F64 = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def tiny_vit(**extra):
    import transformers
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, num_labels=3, **extra)
    return transformers.ViTForImageClassification(cfg)


class HFLit(pl.LightningModule):
    """The usual Hugging Face training step: the model computes its own loss from ``labels``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def eager(model):
    """A float64 copy with eager attention: PyTorch's CPU SDPA kernel has no forward-mode AD."""
    ref = copy.deepcopy(model).to(F64)
    if hasattr(ref, "set_attn_implementation"):
        ref.set_attn_implementation("eager")
    else:
        ref.config._attn_implementation = "eager"
    return ref


def dict_loader(dtype=torch.float32, n=8):
    g = torch.Generator().manual_seed(0)
    items = [{"pixel_values": torch.randn(1, 8, 8, generator=g).to(dtype), "labels": i % 3} for i in range(n)]
    return torch.utils.data.DataLoader(items, batch_size=n)


# --------------------------------------------------------------------------- Hugging Face


def test_hf_vit_gradient_with_output_key_matches_finite_differences():
    """Loss inside forward (labels=), ModelOutput output: the gradient of CE + w ||J u||^2 / B equals central
    differences of that loss computed with torch.func.jvp (float64). (On this ViT the autodiff references,
    torch.func.jvp + backward and double backward, give wrong second-order gradients; the differences of the
    exact torch.func values agree with jvpreg to ~1e-8.)"""
    torch.manual_seed(0)
    vit = tiny_vit()
    loader = dict_loader(F64)
    batch = next(iter(loader))
    x, y = batch["pixel_values"], batch["labels"]
    cb = JacobianRegularizer(0.5, seed=3, module="model", input_key="pixel_values", output_key="logits")
    (u,), _ = twin_u(cb.penalty, x)
    ref = eager(vit)
    cap = GradCapture()
    from jvpreg.clone.eager import dispatch
    dispatch.WARNED_FALLBACKS.discard("torch._C._nn.cross_entropy_loss")  # the engine warns once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([cb, cap], precision="64-true").fit(HFLit(vit), loader)
    assert not [w for w in caught if issubclass(w.category, JVPFallbackWarning)], [str(w.message) for w in caught]

    def loss(model):
        logits, ju = torch.func.jvp(lambda z: model(pixel_values=z).logits, (x,), (u,))
        return float(F.cross_entropy(logits, y) + 0.5 * ju.pow(2).sum() / 8), float(ju.pow(2).sum() / 8)

    assert cb.last_value == pytest.approx(loss(ref)[1], rel=1e-6)  # SDPA (jvpreg) vs eager attention (ref)
    params = dict(ref.named_parameters())
    for name, idx in [("vit.embeddings.cls_token", (0, 0, 1)), ("vit.layers.0.attention.v_proj.bias", (1,)),
                      ("vit.layers.0.mlp.fc2.bias", (0,)), ("vit.layers.0.layernorm_after.weight", (2,))]:
        fds = []
        for h in (1e-3, 5e-4):
            vals = []
            for sign in (1, -1):
                with torch.no_grad():
                    params[name][idx] += sign * h
                    vals.append(loss(ref)[0])
                    params[name][idx] -= sign * h
            fds.append((vals[0] - vals[1]) / (2 * h))
        fd = (4 * fds[1] - fds[0]) / 3  # Richardson: O(h^4)
        assert float(cap.grads[0]["model." + name][idx]) == pytest.approx(fd, rel=2e-4, abs=1e-9), name


def test_callback_output_key_equals_the_penalty_route_and_leaves_the_penalty_alone():
    torch.manual_seed(0)
    vit = tiny_vit()
    values = []
    own = JacobianFrobenius(seed=1)
    for cb in (JacobianRegularizer(1.0, seed=1, module="model", input_key="pixel_values", output_key="logits"),
               JVPRegularizer(JacobianFrobenius(seed=1, output_key="logits"), 1.0, module="model",
                              input_key="pixel_values"),
               JVPRegularizer(own, 1.0, module="model", input_key="pixel_values", output_key="logits")):
        make_trainer([cb]).fit(HFLit(copy.deepcopy(vit)), dict_loader())
        values.append(cb.last_value)
    assert values[0] == values[1] == values[2]
    assert own.output_key is None  # the callback scored a copy


def tiny_bert():
    import transformers
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class Text(pl.LightningModule):
    """Token ids embedded in the step, the encoder on ``inputs_embeds`` (and the batch's mask, if it has one)."""

    def __init__(self, bert):
        super().__init__()
        self.bert, self.head = bert, nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        emb = self.bert.get_input_embeddings()(batch["input_ids"])
        out = self.bert(inputs_embeds=emb, attention_mask=batch.get("attention_mask")).pooler_output
        return F.cross_entropy(self.head(out), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_bert_inputs_embeds_penalty_matches_torch_func():
    bert = tiny_bert()
    g = torch.Generator().manual_seed(0)
    items = [{"input_ids": torch.randint(0, 50, (6,), generator=g), "labels": i % 3} for i in range(4)]
    loader = torch.utils.data.DataLoader(items, batch_size=4)
    cb = JacobianRegularizer(1.0, seed=2, module="bert", input_key="inputs_embeds", output_key="pooler_output")
    ref = eager(bert)
    emb = ref.get_input_embeddings()(next(iter(loader))["input_ids"])
    (u,), _ = twin_u(cb.penalty, emb)
    make_trainer([cb], precision="64-true").fit(Text(bert), loader)
    _, ju = torch.func.jvp(lambda z: ref(inputs_embeds=z).pooler_output, (emb,), (u,))
    assert cb.last_value == pytest.approx(float(ju.pow(2).sum() / 4), rel=1e-8)


@pytest.mark.slow
def test_bert_with_padding_masks_is_captured_and_equals_the_eager_engine():
    """The mask preparation reads the mask's values (``mask.all()``): guarded, one program for padded batches and
    one for full ones, every penalty equal to the eager engine's."""
    from jvpreg.clone import JVPCaptureWarning
    from jvpreg.clone.program import capture

    bert = tiny_bert()
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(8):  # the first batch padded, the second full
        mask = torch.ones(6, dtype=torch.long)
        mask[6 - (i % 3 + 1) if i < 4 else 6:] = 0
        items.append({"input_ids": torch.randint(0, 50, (6,), generator=g), "attention_mask": mask, "labels": i % 3})
    values = {}
    for engine in ("auto", "eager"):
        model = Text(copy.deepcopy(bert))
        seen = []

        class Record(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                seen.append(cb.last_value)

        cb = JacobianRegularizer(1.0, seed=2, module="bert", input_key="inputs_embeds", output_key="pooler_output",
                                 engine=engine)
        loader = torch.utils.data.DataLoader(items, batch_size=4)
        with warnings.catch_warnings():
            warnings.simplefilter("error", JVPCaptureWarning)
            make_trainer([cb, Record()], max_steps=6, max_epochs=3, precision="64-true").fit(model, loader)
        values[engine] = seen
        if engine == "auto":
            progs = list(capture.programs(model.bert).values())
            assert len(progs) == 1 and progs[0].gm is not None and len(progs[0].variants) == 1
    assert len(values["auto"]) == 6 and values["auto"] == pytest.approx(values["eager"], rel=1e-12, abs=0)


def test_hf_errors_name_the_fix():
    vit = tiny_vit()
    with pytest.raises(TypeError, match=r"the model returned a ImageClassifierOutput; pass output_key=<index, key or "
                                        r"attribute>.*tensors in it: 'loss', 'logits'"):
        make_trainer([JacobianRegularizer(1.0, module="model", input_key="pixel_values")]).fit(HFLit(vit), dict_loader())
    with pytest.raises(ValueError, match=r"output_key='logit' does not select an output.*tensors in it: 'loss', "
                                         r"'logits'"):
        make_trainer([JacobianRegularizer(1.0, module="model", input_key="pixel_values", output_key="logit")]).fit(
            HFLit(vit), dict_loader())
    with pytest.raises(ValueError, match=r"input_key='pixel' selects nothing in this call of "
                                         r"ViTForImageClassification.forward\(pixel_values.*Set input_key to the name "
                                         r"of the float input argument \(one of 'pixel_values'\)"):
        make_trainer([JacobianRegularizer(1.0, module="model", input_key="pixel", output_key="logits")]).fit(
            HFLit(vit), dict_loader())
    with pytest.raises(ValueError, match=r"input_index=0 does not select the input. Set input_key to the keyword "
                                         r"of the input \(one of 'pixel_values'\)"):
        make_trainer([JacobianRegularizer(1.0, module="model", output_key="logits")]).fit(HFLit(vit), dict_loader())


# --------------------------------------------------------------------------- dict batches, positions


class DictForward(Lit):
    def forward(self, batch):
        return self.net(batch["image"])

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch), batch["label"])


def dict_items():
    g = torch.Generator().manual_seed(0)
    items = [{"image": torch.randn(1, 4, 4, generator=g), "mask": torch.ones(3, dtype=torch.long),
              "label": i % 3} for i in range(8)]
    return torch.utils.data.DataLoader(items, batch_size=8)


def test_dict_input_without_input_key_names_input_key_and_the_float_entries():
    with pytest.raises(TypeError, match=r"DictForward.forward received a dict at input_index=0; pass "
                                        r"input_key=<the key of the input to regularize> \(float tensors in it: "
                                        r"'image'\)"):
        make_trainer([JacobianRegularizer(1.0)]).fit(DictForward(mlp_dropout()), dict_items())


def test_integer_input_points_to_inputs_embeds():
    with pytest.raises(TypeError, match=r"input_key='mask' selects a torch.int64 tensor of shape \(8, 3\).*Float "
                                        r"inputs of this call: none.*inputs_embeds"):
        make_trainer([JacobianRegularizer(1.0, input_key="mask")]).fit(DictForward(mlp_dropout()), dict_items())


def test_input_key_binds_a_positional_argument_by_name():
    class TwoArgs(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp_dropout()

        def forward(self, scale, x):
            return self.net(x) * scale

    class PosLit(Lit):
        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(2.0, batch[0]), batch[1])

    loader, x, _ = data()
    net = TwoArgs()
    a, b = (JacobianRegularizer(1.0, seed=0, module="net", input_key="x"),
            JacobianRegularizer(1.0, seed=0, module="net", input_index=1))
    (u,), _ = twin_u(a.penalty, x)
    for cb in (a, b):
        make_trainer([cb]).fit(PosLit(copy.deepcopy(net), lr=0.0), loader)
    _, ju = torch.func.jvp(lambda z: net(2.0, z), (x,), (u,))
    assert a.last_value == b.last_value == pytest.approx(float(ju.pow(2).sum() / 8), rel=1e-5)


# --------------------------------------------------------------------------- several of one class, logs


def test_two_regularizers_of_one_class_resume_each_with_its_own_state(tmp_path):
    def callbacks():
        return [SpectralRegularizer(0.1, seed=1, module="net"), SpectralRegularizer(0.2, seed=2, module="net")]

    loader, _, _ = data(n=4, batch=4)
    first, model = callbacks(), Lit(mlp_dropout())
    trainer = make_trainer(first, max_steps=2)
    trainer.fit(model, loader)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    states = torch.load(tmp_path / "c.ckpt", weights_only=False)["callbacks"]
    assert {k for k in states if k.startswith("SpectralRegularizer")} == {c.state_key for c in first}
    assert not torch.equal(first[0].penalty.vectors, first[1].penalty.vectors)
    restored = callbacks()
    make_trainer(restored, max_steps=2).fit(Lit(mlp_dropout()), loader, ckpt_path=tmp_path / "c.ckpt")
    for a, b in zip(first, restored):
        assert b.steps_applied == 2
        torch.testing.assert_close(a.penalty.vectors, b.penalty.vectors)


def test_penalty_and_total_loss_on_the_progress_bar_and_opt_out():
    loader, _, _ = data()
    trainer = make_trainer([JacobianRegularizer(0.5, seed=0)])
    model = Lit(mlp_dropout(), lr=0.0)
    trainer.fit(model, loader)
    bar = trainer.progress_bar_metrics
    task = F.cross_entropy(model.seen_outputs[0], next(iter(loader))[1])
    assert bar["train/total_loss"] == pytest.approx(float(task) + 0.5 * bar["train/jacobian_frobenius"], rel=1e-5)
    trainer = make_trainer([JacobianRegularizer(0.5, prog_bar=False)])
    trainer.fit(Lit(mlp_dropout()), loader)
    assert "train/jacobian_frobenius" not in trainer.progress_bar_metrics
    assert "train/total_loss" not in trainer.progress_bar_metrics
    assert "train/total_loss" in trainer.callback_metrics


def test_output_key_arguments_checked_at_init():
    with pytest.raises(TypeError, match=r"JVPRegularizer\(\.\.\.\): expected output_key to be None, an int \(index\) "
                                        r"or a str \(key or attribute of the output, e.g. 'logits'\), got 1.5"):
        JVPRegularizer(JacobianFrobenius(), 1.0, output_key=1.5)
    with pytest.raises(ValueError, match=r"output_key='logits' conflicts with JacobianFrobenius\(output_key=0\); "
                                         r"set it in one place"):
        JVPRegularizer(JacobianFrobenius(output_key=0), 1.0, output_key="logits")
    with pytest.raises(TypeError, match=r"expected prog_bar to be a bool, got 'yes'"):
        TangentPropRegularizer(1.0, prog_bar="yes")


def test_output_key_selects_a_field_of_a_namedtuple_output_by_name():
    Out = collections.namedtuple("Out", ["features", "logits"])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp_dropout()

        def forward(self, x):
            return Out(x.flatten(1), self.net(x))

    class TupleLit(Lit):
        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]).logits, batch[1])

    loader, x, _ = data()
    net = Net()
    cb = JacobianRegularizer(1.0, seed=0, module="net", output_key="logits")
    (u,), _ = twin_u(cb.penalty, x)
    make_trainer([cb]).fit(TupleLit(copy.deepcopy(net), lr=0.0), loader)
    _, ju = torch.func.jvp(lambda z: net.net(z), (x,), (u,))
    assert cb.last_value == pytest.approx(float(ju.pow(2).sum() / 8), rel=1e-5)


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("module", [None, pytest.param("net", marks=pytest.mark.slow)],
                         ids=["lightning-module", "compiled-net"])
def test_compiled_network_is_regularized_exactly(module):
    """A torch.compile'd network (regularized through its LightningModule, or as the module itself) gives
    the penalty of the uncompiled network."""
    loader, x, _ = data()
    torch.manual_seed(0)
    net = mlp_dropout()
    _, want = JacobianFrobenius(seed=0)(copy.deepcopy(net), x)  # the uncompiled network's penalty
    cb = JacobianRegularizer(1.0, seed=0, module=module)
    make_trainer([cb]).fit(Lit(torch.compile(copy.deepcopy(net), backend="eager"), lr=0.0), loader)
    assert cb.last_value == pytest.approx(float(want), rel=1e-5)


def test_validation_jacobian_and_monitor_take_the_output_key():
    from jvpreg.callbacks import JacobianMonitor

    torch.manual_seed(0)
    vit = tiny_vit()

    class HFVal(HFLit):
        def validation_step(self, batch, batch_idx):
            self.log("val/loss", self.model(**batch).loss)

    monitor = JacobianMonitor(k=2, n_samples=4, max_samples=4, plot=False, output_key="logits",
                              forward_fn=lambda m, x: m.model(pixel_values=x), input_fn=lambda b: b["pixel_values"])
    cb = JacobianRegularizer(1e-3, module="model", input_key="pixel_values", output_key="logits",
                             log_val_jacobian=True)
    trainer = make_trainer([cb, monitor], limit_val_batches=1)
    trainer.fit(HFVal(vit), dict_loader(), dict_loader())
    vit.eval()
    x = next(iter(dict_loader()))["pixel_values"]
    eager_vit = eager(vit).float()
    jac = torch.func.vmap(torch.func.jacrev(lambda z: eager_vit(pixel_values=z[None]).logits[0]))(x)
    _, one_projection = JacobianFrobenius(seed=0, output_key="logits")(vit, x)  # the documented route
    assert float(trainer.callback_metrics["val/jacobian_fro"]) == pytest.approx(float(one_projection.sqrt()), rel=1e-5)
    sigma1 = torch.linalg.matrix_norm(jac[:4].flatten(2), ord=2).mean()  # max_samples=4
    assert float(trainer.callback_metrics["jacobian/sigma_1"]) == pytest.approx(float(sigma1), rel=1e-2)
    with pytest.raises(TypeError, match=r"JacobianMonitor\(output_key=...\): expected None, an int \(index\) or a str"):
        JacobianMonitor(output_key=["logits"])


@pytest.mark.parametrize("engine", [pytest.param("auto", marks=pytest.mark.slow), "eager"])
def test_hf_gradient_checkpointing_in_a_fit_has_the_gradients_without_it(engine):
    """``gradient_checkpointing_enable()``: the regularized step's gradients equal those without checkpointing."""
    torch.manual_seed(0)
    model = tiny_vit().to(F64).train()
    grads = {}
    for checkpointing in (False, True):
        m = copy.deepcopy(model)
        if checkpointing:
            m.gradient_checkpointing_enable()
        cap = GradCapture()
        cb = JacobianRegularizer(1.0, seed=2, module="model", input_key="pixel_values", output_key="logits",
                                 engine=engine)
        make_trainer([cb, cap], max_steps=2, precision="64-true").fit(HFLit(m), dict_loader(F64))
        grads[checkpointing] = cap.grads
    for want, got in zip(*grads.values()):
        assert want.keys() == got.keys()
        scale = max(float(g.abs().max()) for g in want.values())  # the key bias's is rounding noise (softmax
        for n in want:                                              # ignores it): compared on the global scale
            torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-12 * scale, msg=n)
