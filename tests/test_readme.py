"""The README's quickstart runs as written, its numbers agree with torch.func where it can run, and its test
command is the one CI runs."""
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


def test_readme_test_command_is_the_one_ci_runs():
    """CI (``.ci/run``) runs exactly the README's command for every test: the two may not drift apart."""
    ci = (README.parent / ".ci" / "run").read_text()
    ci_cmd = [line.strip() for line in ci.splitlines() if line.strip().startswith("python -m pytest")]
    readme_cmd = [line.split("#")[0].strip() for line in README.read_text().split("```bash", 1)[1].split("```")[0]
                  .splitlines() if "--slow" in line]
    assert len(ci_cmd) == 1 and readme_cmd == ci_cmd, (ci_cmd, readme_cmd)
