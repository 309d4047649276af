"""The README's quickstart runs as written, its numbers agree with torch.func where it can run, and its test
command is the one CI runs."""
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _quickstart() -> str:
    text = README.read_text()
    section = text.split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _double_backward_jvp(f, x, u):
    """``J u`` of ``f`` at ``x`` as ``d/dv <J^T v, u>`` (two reverse passes): torch.func.jvp fails on train-mode
    BatchNorm, which the quickstart uses."""
    x = x.detach().requires_grad_()
    y = f(x)
    v = torch.zeros_like(y, requires_grad=True)
    (g,) = torch.autograd.grad(y, x, v, create_graph=True)
    (ju,) = torch.autograd.grad(g, v, u)
    return ju


@pytest.mark.slow
def test_readme_quickstart_runs_and_its_jvps_are_exact():
    """The quickstart as written, in float64 (the default dtype for the run): its three JVPs equal the reverse-mode
    references (train-mode BatchNorm's output does not read the running stats the calls update), and its backward
    reaches the parameters."""
    torch.manual_seed(0)
    scope: dict = {}
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        exec(compile(_quickstart(), str(README), "exec"), scope)
        model, x, u, U, W = (scope[k] for k in ("model", "x", "u", "U", "W"))
        assert scope["Ju"].dtype == torch.float64 and model.training
        assert scope["Ju"].shape == scope["y"].shape == (8, 10) and scope["JU"].shape == (4, 8, 10)
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        torch.testing.assert_close(scope["Ju"], _double_backward_jvp(model, x, u), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(scope["JU"][2], _double_backward_jvp(model, x, U[2]), rtol=1e-10, atol=1e-10)
        name = "layer3.0.conv1.weight"
        weight = dict(model.named_parameters())[name]
        with_weight = lambda w: torch.func.functional_call(model, {name: w}, (x,))  # noqa: E731
        torch.testing.assert_close(scope["JW"], _double_backward_jvp(with_weight, weight, W), rtol=1e-10, atol=1e-10)
    finally:
        torch.set_default_dtype(old)


def test_readme_test_command_is_the_one_ci_runs():
    """CI (``.ci/run``) runs exactly the README's command for every test: the two may not drift apart."""
    ci = (README.parent / ".ci" / "run").read_text()
    ci_cmd = [line.strip() for line in ci.splitlines() if line.strip().startswith("python -m pytest")]
    readme_cmd = [line.split("#")[0].strip() for line in README.read_text().split("```bash", 1)[1].split("```")[0]
                  .splitlines() if "--slow" in line]
    assert len(ci_cmd) == 1 and readme_cmd == ci_cmd, (ci_cmd, readme_cmd)
