"""``scripts/bench_packed_forward.py``: the shared forward packed inside the program vs outside it, side by side (a
smoke run: the figures themselves are the script's, on a quiet machine)."""
from __future__ import annotations

import pytest

from conftest import load_script
from jvpreg.callbacks.shared import SharedForward


@pytest.mark.slow
def test_the_benchmark_measures_both_ways_and_leaves_the_shared_forward_as_it_found_it():
    bench = load_script("bench_packed_forward")
    packs = SharedForward._packs_in_program
    rows = bench.steps("mlp200:8", "auto", repeats=2, warmup=3)
    assert SharedForward._packs_in_program is packs
    assert [r["model"] for r in rows] == ["mlp200 (B=8)"]
    keys = ("plain_2b (ms)", "double_backprop (ms)", "auto: packed inside (ms)", "auto: packed outside (ms)")
    assert all(rows[0][k] > 0 for k in keys)
    text = bench.markdown({"command": "c", "machine": "m", "engines": ["auto"], "steps": rows})
    assert "| mlp200 (B=8) | auto |" in text


def test_the_packed_outside_switch_takes_the_clone_batch_path():
    import torch
    from torch import nn

    from jvpreg.losses import JacobianFrobenius

    bench = load_script("bench_packed_forward")
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    shared = SharedForward(net, engine="captured")
    seen = []
    for context in (bench.packed_outside, bench.contextlib.nullcontext):
        with context():
            shared.arm([(JacobianFrobenius(seed=0), 1.0, 1.0)])
            net(torch.randn(5, 3))
            seen.append(shared.plan.x_in is None)
            shared.disarm()
    assert seen == [False, True]
