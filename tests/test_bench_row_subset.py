"""jvpreg.bench row_subset and the row-subset methods of jvpreg.bench train: they run, write their tables, and
a row subset keeps fewer bytes for backward than the whole-batch clone step."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from jvpreg.bench import row_subset, train


def test_train_bench_row_subsets_save_less_for_backward_than_the_whole_batch():
    torch.manual_seed(0)
    model, shape = train.build("mlp")
    x = torch.randn(16, *shape)
    y, u = torch.randint(0, 10, (16,)), torch.randn_like(x)
    saved = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in ("plain", "clone", "clone_rows50", "clone_rows25"):
            step = train.Step(method, model, x, y, u)
            for _ in range(3):
                step()
            saved[method] = train.saved_for_backward(step)
    assert saved["plain"] < saved["clone_rows25"] < saved["clone_rows50"] < saved["clone"]


@pytest.mark.slow
def test_row_subset_bench_quick_run_writes_its_tables(tmp_path):
    out = str(tmp_path / "rs")
    assert row_subset.main(["--quick", "--settings", "digits", "--draws", "2", "--out", out]) == 0
    result = json.loads((tmp_path / "rs.json").read_text())
    (setting,) = result["settings"]
    assert [r["method"] for r in setting["rows"]] == list(row_subset.METHODS)
    by = {r["method"]: r for r in setting["rows"]}
    assert by["rows25"]["row_subset"] == 0.25 and "rel_variance" in by["rows25"] and "rel_variance" not in by["plain"]
    assert all(0.0 <= r["clean_acc"] <= 1.0 and r["jacobian_fro"] > 0 for r in setting["rows"])
    assert len(result["verdicts"]) == 3
    assert (tmp_path / "rs.png").stat().st_size > 0 and "## digits" in (tmp_path / "rs.md").read_text()
