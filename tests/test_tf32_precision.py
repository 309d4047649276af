"""``scripts/tf32_precision.py``: with TF32 convolutions (a GPU's float32 default), emulated on the CPU, the clone
engine's JVP is as precise as torch.func.jvp's (both read the same rounded tangent), and the emulation rounds."""
from __future__ import annotations

import pytest
import torch
from conftest import load_script

from jvpreg.bench.report import read_json


@pytest.fixture(scope="module")
def tf32():
    return load_script("tf32_precision")


def test_tf32_rounding_keeps_ten_mantissa_bits_rounding_to_nearest_even(tf32):
    x = torch.tensor([1 + 2 ** -10, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -12, -3.0])
    torch.testing.assert_close(tf32.to_tf32(x), torch.tensor([1 + 2 ** -10, 1.0, 1 + 2 ** -9, 1.0, -3.0]),
                               rtol=0, atol=0)


@pytest.mark.slow
def test_clone_jvp_is_as_precise_as_torch_func_with_tf32_convolutions(tf32, tmp_path):
    out = tmp_path / "tf32"
    assert tf32.main(["--models", "resnet18", "--size", "32", "--out", str(out)]) == 0
    (r,) = read_json(out.with_suffix(".json"))["rows"]
    assert r["clone_fp32"] < 1e-5 and r["func_fp32"] < 1e-5
    assert r["func_tf32"] > 100 * r["func_fp32"]  # the emulation is on: TF32 loses ~3 digits
    assert r["clone_tf32"] < 1.5 * r["func_tf32"]
    assert "| resnet18 | 2x3x32x32 |" in out.with_suffix(".md").read_text()
