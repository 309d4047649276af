"""``python -m jvpreg.bench clients``: one model end to end, the engine column, and the markdown."""
from __future__ import annotations

import json

import pytest
import torch

from jvpreg.bench import clients


@pytest.mark.slow
def test_bench_clients_runs_one_model_and_writes_its_table(tmp_path):
    stem = tmp_path / "clients"
    assert clients.main(["--models", "fno", "--repeats", "1", "--warmup", "2", "--out", str(stem)]) == 0
    data = json.loads((tmp_path / "clients.json").read_text())
    (row,) = data["rows"]
    assert row["model"] == "fno" and row["engine"] == "captured" and row["capture_warnings"] == []
    assert set(row["median_s"]) == set(clients.METHODS)
    assert row["errors"]["torch.func.jvp"] < 1e-4 and row["errors"]["autograd.functional.jvp"] < 1e-4  # float32
    md = (tmp_path / "clients.md").read_text()
    assert "| fno | neuraloperator | module | captured |" in md and "Geometric mean of jvpreg / forward 2B" in md


def test_engine_used_tells_a_replay_from_an_eager_run():
    import jvpreg

    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    x, u = torch.randn(2, 3), torch.randn(2, 3)
    before = clients.replays(net)
    jvpreg.jvp(net, (x,), (u,))  # a signature's first call: eager
    assert clients.engine_used(net, before) == "eager"
    jvpreg.jvp(net, (x,), (u,))
    before = clients.replays(net)
    jvpreg.jvp(net, (x,), (u,))
    assert clients.engine_used(net, before) == "captured"
    before = clients.replays(net)
    jvpreg.jvp(net, (x,), (u,), engine="eager")
    assert clients.engine_used(net, before) == "eager"
