"""``scripts/op_counts.py``: kernels per call on the CPU's path and on an accelerator's (``meta``), counted alike; the
counts that bound the per-call work a GPU launches (the scale choice, a regularized BatchNorm's backward)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import load_script
from jvpreg.bench import train as bench_train
from jvpreg.clone.api import _R_DEFAULT, device_scales

META = torch.device("meta")


@pytest.mark.slow
def test_a_jvp_call_of_the_mlp_names_its_layers_and_reads_no_value_on_the_accelerator_path():
    ops = load_script("op_counts")
    row = ops.jvp_row("small", "mlp20x64")  # 20 x (Linear 64 + ReLU)
    assert row["forward_2B_cpu"] == row["forward_2B_accelerator"] == 42  # 20 addmm, 20 relu, [x; x + u]
    assert "threshold_backward +20" in row["extra_cpu"]  # the ReLU rule's kernel
    assert row["host_reads_cpu"] == 2 and row["host_reads_accelerator"] == 0  # the norms of x and u, on the host
    # on an accelerator the scales are kernels in the program and the non-finite fix of the output stays
    assert "linalg_vector_norm +2" in row["extra_accelerator"] and "exp2 +1" in row["extra_accelerator"]
    assert row["captured_accelerator"] <= row["forward_2B_accelerator"] + 25


def test_the_device_scale_choice_is_fifteen_kernels():
    """Each is a launch on a GPU, where a small model's JVP is launch-bound (28 before: masks for the special cases)."""
    ops = load_script("op_counts")
    x, u = torch.randn(4, 64, device=META), torch.randn(1, 4, 64, device=META)
    count = ops.counted(lambda: device_scales([(x, u)], 1, _R_DEFAULT))
    assert count.kernels <= 15 and count.host_reads == 0, count.launching()


def _bn_blocks(n):
    layers = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(n):
        layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


@pytest.mark.slow
def test_a_regularized_batch_norm_block_launches_at_most_31_kernels_more_than_the_plain_2b_step():
    """Train-mode BatchNorm + ReLU + conv, one training step on the accelerator path: what one more block adds to the
    regularized step (captured) beyond what it adds to the plain step on the doubled batch (19 kernels: forward,
    backward, SGD). 61 before the backward's per-channel coefficients were shared (36 small kernels, then 18); 45
    before the accelerator's backward took the form with a third BatchNorm kernel and 6 small ones
    (:func:`jvpreg.clone.rules.batch_norm.few_launches`)."""
    ops = load_script("op_counts")
    added = {}
    for method in ("plain_2b", "clone"):
        counts = []
        for n in (1, 2):
            torch.manual_seed(0)
            x = torch.randn(4, 3, 8, 8, device=META)
            step = bench_train.Step(method, _bn_blocks(n).to(META), x, torch.randint(0, 10, (4,), device=META),
                                    torch.randn_like(x))
            for _ in range(2):  # a capture, a replay
                step()
            counts.append(ops.counted(step))
        added[method] = counts[1].kernels - counts[0].kernels
        assert counts[1].host_reads == 0
    assert added["plain_2b"] == 19
    assert added["clone"] - added["plain_2b"] <= 31, added


@pytest.mark.slow
def test_main_writes_both_tables(tmp_path):
    ops = load_script("op_counts")
    assert ops.main(["--suites", "", "--train", "mlp200:8", "--out", str(tmp_path / "counts")]) == 0
    text = (tmp_path / "counts.md").read_text()
    assert "One training step on the accelerator path" in text and "| mlp200 | 8 |" in text
    assert "One JVP call" not in text  # no suite asked for
