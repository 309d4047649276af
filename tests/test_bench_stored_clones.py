"""``scripts/bench_stored_clones.py``: the search vs the class assignment, measured side by side (a smoke run: the
figures themselves are the script's, on a quiet machine)."""
from __future__ import annotations

import torch
from torch import nn

from conftest import load_script
from jvpreg.clone.core.session import ROUTES


def test_the_benchmark_measures_both_ways_and_leaves_the_engine_as_it_found_it(tmp_path):
    bench = load_script("bench_stored_clones")
    rows = bench.steps("mlp200:8", repeats=2)
    assert [r["model"] for r in rows] == ["mlp200 (B=8)"]
    assert all(rows[0][k] > 0 for k in ("plain_2b (ms)", "search (ms)", "setattr assigned (ms)"))
    assert bench.SETATTR_ROUTE not in ROUTES
    assert nn.Module.__dict__["__setattr__"] is bench._PLAIN_SETATTR
    costs = bench.class_costs()
    assert costs["nn.Module subclasses"] > 100 and costs["nn.Module.__setattr__ set and put back (us)"] > 0
    text = bench.markdown({"command": "c", "machine": "m", "class_costs": costs,
                           "search_costs": {"mlp200": {"modules": 7, "search (us)": 1.0}}, "steps": rows})
    assert "| mlp200 (B=8) |" in text and "| `nn.Module.__setattr__` |" in text
