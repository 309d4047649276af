"""docs/hf_timm.md: every Python example runs as written (tiny configs, random weights, no downloads)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "hf_timm.md"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _examples():
    text = DOC.read_text()
    out = []
    for title, body in re.findall(r"^### (.+?)\n(.*?)(?=^### |\Z)", text, re.S | re.M):
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", body, re.S)):
            out.append(pytest.param(code, id=re.sub(r"\W+", "_", title).strip("_").lower() + f"_{i}"))
    return out


EXAMPLES = _examples()


def test_the_doc_has_the_four_examples():
    assert len(EXAMPLES) == 4


@pytest.mark.parametrize("code", EXAMPLES)
@pytest.mark.slow
def test_example_runs_and_applies_the_regularizer(code, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    code = code.replace("pl.Trainer(", "pl.Trainer(enable_progress_bar=False, enable_model_summary=False, ")
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)
    reg, trainer = scope["reg"], scope["trainer"]
    assert reg.steps_applied == 2 and math.isfinite(reg.last_value)
    assert f"train/{reg.name}" in trainer.progress_bar_metrics and "train/total_loss" in trainer.progress_bar_metrics


def test_readme_one_liners_build():
    from jvpreg.callbacks import JacobianRegularizer

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("**Hugging Face, timm, dict batches: one line each.**", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    regs = [eval(line.split("#")[0], {"JacobianRegularizer": JacobianRegularizer}) for line in code.splitlines()]
    assert [(r.module, r.input_key, r.output_key) for r in regs] == [
        ("model", "pixel_values", "logits"), ("bert", "inputs_embeds", "pooler_output"), ("net", None, None)]
    assert len({r.state_key for r in regs}) == 3
