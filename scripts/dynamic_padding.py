"""Regularized training of a text classifier on batches padded to their longest sequence (dynamic padding).

Each padded length is a call signature of its own for the captured engine (a program per length, up to
``jvpreg.clone.program.capture.MAX_PROGRAMS`` per module, then eager clone mode with one warning). This script trains a small
Hugging Face BERT (random weights, 2 layers, dim 64) with a ``JacobianRegularizer`` in Lightning on token sequences of
random lengths, unpadded lengths or padded to a multiple, with each engine and without the regularizer, every run in a
fresh process, and reports the time of each epoch (the first holds the captures), the programs recorded and the
warnings given.

    python scripts/dynamic_padding.py [--epochs 3] [--configs 1:2,16:8] [--out experiments/results/dynamic_padding_cpu]

``--configs``: ``pad_multiple:batch_size`` pairs (``1``: every batch padded to its own longest sequence).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

ENGINES = ("none", "eager", "auto")


def run_one(engine: str, epochs: int, pad: int, batch: int) -> dict:
    """One training run in this process (``engine="none"``: no regularizer)."""
    import random
    import time
    import warnings

    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from transformers import BertConfig, BertModel

    from jvpreg.callbacks import JacobianRegularizer
    from jvpreg.clone import JVPCaptureWarning
    from jvpreg.clone.program import capture

    torch.set_num_threads(1)

    class TextClassifier(pl.LightningModule):
        def __init__(self, bert):
            super().__init__()
            self.bert, self.head = bert, torch.nn.Linear(bert.config.hidden_size, 3)

        def training_step(self, batch, batch_idx):
            embeds = self.bert.get_input_embeddings()(batch["input_ids"])
            out = self.bert(inputs_embeds=embeds, attention_mask=batch["attention_mask"])
            return F.cross_entropy(self.head(out.pooler_output), batch["labels"])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def collate(items):
        n = -(-max(len(it["ids"]) for it in items) // pad) * pad
        ids = torch.zeros(len(items), n, dtype=torch.long)
        mask = torch.zeros(len(items), n, dtype=torch.long)
        for i, it in enumerate(items):
            ids[i, :len(it["ids"])], mask[i, :len(it["ids"])] = it["ids"], 1
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([it["label"] for it in items])}

    class EpochTimes(pl.Callback):
        def __init__(self):
            self.times, self.start = [], 0.0

        def on_train_epoch_start(self, *args):
            self.start = time.perf_counter()

        def on_train_epoch_end(self, *args):
            self.times.append(time.perf_counter() - self.start)

    random.seed(0)
    torch.manual_seed(0)
    data = [{"ids": torch.randint(1, 100, (random.randint(4, 60),)), "label": i % 3} for i in range(256)]
    bert = BertModel(BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=128, max_position_embeddings=64))
    timer = EpochTimes()
    callbacks = [timer] + ([] if engine == "none" else [JacobianRegularizer(
        0.01, module="bert", input_key="inputs_embeds", output_key="pooler_output", engine=engine)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False).fit(
            TextClassifier(bert), DataLoader(data, batch_size=batch, shuffle=True, collate_fn=collate))
    programs = capture.programs(bert).values()
    return {"engine": engine, "pad_multiple": pad, "batch": batch, "steps_per_epoch": -(-len(data) // batch),
            "epoch_s": timer.times, "signatures": len(programs), "captured": sum(p.gm is not None for p in programs),
            "warnings": sorted({str(w.message) for w in caught if issubclass(w.category, JVPCaptureWarning)})}


def markdown(rows: list, meta: dict) -> str:
    from jvpreg.bench import report

    epochs = max(len(r["epoch_s"]) for r in rows)
    lines = ["# Dynamic padding: a regularized text classifier, one program per padded length", "",
             f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine']['cpu']} ({meta['machine']['cpu_cores']} cores, 1 torch thread), torch "
             f"{meta['machine']['torch']}; {meta['git']}", "",
             "A Hugging Face BERT (random weights, 2 layers, dim 64, 2 heads) with a classification head, trained in "
             "Lightning on 256 token sequences of random lengths 4-60 with `JacobianRegularizer(0.01)` on "
             "`inputs_embeds` (`none`: without it); each run in a fresh process. *Signatures*: the call signatures the "
             "captured engine saw (one per padded length and mode), *captured*: those it recorded a program for "
             f"(at most `MAX_PROGRAMS`); the others ran in eager clone mode.", ""]
    head = ["pad to a multiple of", "batch", "steps/epoch", "engine"] + [f"epoch {i + 1} (s)" for i in range(epochs)]
    head += ["signatures", "captured", "warnings"]
    body = [[r["pad_multiple"], r["batch"], r["steps_per_epoch"], r["engine"],
             *[f"{t:.2f}" for t in r["epoch_s"]], r["signatures"] if r["engine"] != "none" else "",
             r["captured"] if r["engine"] != "none" else "", len(r["warnings"])] for r in rows]
    lines.append(report.md_table(head, body))
    notes = sorted({w for r in rows for w in r["warnings"]})
    if notes:
        lines += ["", "Warnings:", ""] + [f"- {w}" for w in notes]
    return "\n".join(lines) + "\n"


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--configs", default="1:2,16:8", help="pad_multiple:batch pairs, comma-separated")
    ap.add_argument("--out", default="experiments/results/dynamic_padding_cpu")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # engine:pad:batch, run in this process (the workers)
    args = ap.parse_args(argv)
    if args.one:
        engine, pad, batch = args.one.split(":")
        print(json.dumps(run_one(engine, args.epochs, int(pad), int(batch))))
        return 0
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        ap.error("needs Hugging Face transformers: pip install -e \".[hf]\"")
    try:
        configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    except ValueError:
        ap.error(f"--configs: expected pad_multiple:batch pairs such as 1:2,16:8, got {args.configs!r}")
    rows = []
    for pad, batch in configs:
        for engine in ENGINES:
            print(f"pad {pad}, batch {batch}, {engine} ...", file=sys.stderr, flush=True)
            done = subprocess.run([sys.executable, __file__, "--epochs", str(args.epochs), "--one",
                                   f"{engine}:{pad}:{batch}"], capture_output=True, text=True, check=False)
            if done.returncode:
                sys.stderr.write(done.stderr[-3000:])
                return done.returncode
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    import torch

    from jvpreg.bench import report
    from jvpreg.bench.timing import machine_description

    torch.set_num_threads(1)
    meta = {"command": report.command_line("python scripts/dynamic_padding.py", sys.argv[1:] if argv is None else argv),
            "machine": machine_description(), "git": report.describe_git(report.git_state())}
    md = markdown(rows, meta)
    report.write_results(args.out, md, {"meta": meta, "rows": rows})
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
