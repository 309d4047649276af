"""``scripts/op_counts.py``: the ATen ops of the plain 2B forward and of the captured program, counted alike."""
from __future__ import annotations

from conftest import load_script


def test_op_counts_of_the_mlp_name_its_layers_and_the_relu_rule():
    ops = load_script("op_counts")
    row = ops.model_row("small", "mlp20x64")  # 20 x (Linear 64 + ReLU)
    assert row["forward_2B"] == 40  # 20 addmm + 20 relu on the 2B rows
    assert row["captured"] > row["forward_2B"] and "threshold_backward +20" in row["extra"]  # the ReLU rule's
    assert row["captured_all"] >= row["captured"]
