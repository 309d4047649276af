"""Tests for the paper benchmark (``jvpreg.bench.paper``) and the operator benchmark.

The grid runs end to end at tiny sizes (rnn + unet, 16x16, batch 2, one timed run): files are
written, cells are checked against clone, failures (injected) are recorded rather than raised.
"""
from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
from torch import nn

from jvpreg.bench import operators, paper

TINY = ["--image-size", "16", "--batch-size", "2", "--repeats", "1", "--warmup", "0", "--quiet",
        "--steady-malloc", "off"]  # mallopt is process-wide: keep it out of the test process


@pytest.fixture(autouse=True)
def _one_thread():
    """Benchmarks set torch's thread count with --threads; keep the test process unchanged."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("paper")
    rc = paper.main(["--models", "rnn,unet", *TINY, "--threads", "1", "--profile", "none",
                     "--out", str(out), "--name", "tiny"])
    assert rc == 0
    return out, json.loads((out / "tiny.json").read_text())


@pytest.mark.slow
def test_grid_writes_json_markdown_and_plot(grid):
    out, result = grid
    assert (out / "tiny.md").stat().st_size > 0
    png = (out / "tiny_speedup.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    machine = result["machine"]
    assert machine["cpu"] and machine["torch"] == torch.__version__ and "gpu" in machine
    assert result["command"].startswith("python -m jvpreg.bench paper --models rnn,unet")
    assert [(r["model"], r["kind"]) for r in result["rows"]] == [("rnn", "x"), ("rnn", "w"), ("unet", "x"), ("unet", "w")]


@pytest.mark.slow
def test_grid_cells_are_timed_and_checked_against_clone(grid):
    _, result = grid
    for row in result["rows"]:
        cells = row["cells"]
        assert set(cells) == set(paper.METHODS)
        assert cells["clone"]["status"] == "ok" and cells["fwd_2b"]["status"] == "ok"
        for name, c in cells.items():
            if c["status"] != "ok":
                assert c["reason"] and c["status"] in ("oom", "fails")
                continue
            assert {"median", "mean", "std", "min", "repeats"} <= set(c) and c["median"] > 0
            if paper.METHODS[name].alternative:
                assert c["max_rel_diff"] < 1e-4, (row["model"], row["kind"], name, c["max_rel_diff"])
        assert row["summary"]["speedup"] is not None and row["summary"]["clone_over_fwd2b"] > 0
    assert result["rows"][1]["first_layer"] == "rnn.weight_ih_l0"
    assert result["rows"][3]["first_layer"] == "inc.0.weight"
    summ = result["summary"]["small"]["x"]
    assert summ["models"] == 2 and summ["speedup_geo"] > 0


@pytest.mark.slow
def test_markdown_is_laid_out_like_the_paper(grid):
    out, result = grid
    md = (out / "tiny.md").read_text()
    assert result["command"] in md
    assert md.count("| Model | # params |") == 2  # one table per JVP kind
    for header in ("batch-jacobian", "jvp (torch.func)", "double vjp", "clone (ours)", "speed-up", "fwd 2B",
                   "clone / fwd 2B"):
        assert header in md
    assert md.count("**arithmetic average**") == 2 and md.count("**geometric average**") == 2


def _raise(exc):
    def build(problem):
        def run():
            raise exc
        return run
    return build


@pytest.mark.slow
def test_failing_methods_are_recorded_not_raised(monkeypatch, tmp_path):
    monkeypatch.setitem(paper.METHODS, "broken", paper.Method("broken", "broken", _raise(RuntimeError("boom: injected"))))
    monkeypatch.setitem(paper.METHODS, "oomer", paper.Method(
        "oomer", "oomer", _raise(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))))
    monkeypatch.setitem(paper.METHODS, "huge", paper.Method(
        "huge", "huge", _raise(AssertionError("never called")), memory=lambda p: 1 << 50))
    rc = paper.main(["--models", "rnn", "--kinds", "x", "--methods", "clone,fwd_2b,broken,oomer,huge", *TINY,
                     "--profile", "none", "--no-plot", "--out", str(tmp_path), "--name", "f"])
    assert rc == 0
    row = json.loads((tmp_path / "f.json").read_text())["rows"][0]
    assert row["cells"]["broken"] == {"status": "fails", "reason": "RuntimeError: boom: injected",
                                      "error": "RuntimeError: boom: injected"}
    assert row["cells"]["oomer"]["status"] == "oom"
    assert row["cells"]["huge"]["status"] == "oom" and row["cells"]["huge"]["estimated"]
    assert row["summary"]["speedup"] == "inf"  # every alternative failed: the paper's ∞
    md = (tmp_path / "f.md").read_text()
    assert "fails: RuntimeError: boom: injected" in md and "| - |" in md and "-*" in md and "∞" in md


@pytest.mark.slow
def test_a_model_that_cannot_be_built_is_a_failed_row(monkeypatch, tmp_path):
    monkeypatch.setattr(paper, "model_setting", lambda name, size: (size, {"bogus_kwarg": 1}))
    rc = paper.main(["--models", "rnn", "--kinds", "x", "--methods", "clone,func_jvp", *TINY, "--profile", "none",
                     "--no-plot", "--out", str(tmp_path), "--name", "b"])
    assert rc == 0
    row = json.loads((tmp_path / "b.json").read_text())["rows"][0]
    assert {c["status"] for c in row["cells"].values()} == {"fails"}
    assert "bogus_kwarg" in row["cells"]["clone"]["error"]


@pytest.mark.parametrize("builder, expected", [
    (lambda: nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3), nn.Linear(4, 2)), "1.weight"),
    (lambda: nn.Sequential(nn.Flatten(), nn.Linear(12, 2)), "1.weight"),
    (lambda: nn.RNN(4, 5), "weight_ih_l0"),
    (lambda: nn.Sequential(nn.LayerNorm(3), nn.ConvTranspose2d(3, 3, 2)), "1.weight"),
], ids=["bn-then-conv", "linear", "rnn", "layernorm-then-convT"])
def test_first_layer_weight(builder, expected):
    assert paper.first_layer_weight(builder()) == expected


def test_first_layer_weight_error_names_the_model():
    with pytest.raises(ValueError, match="Sequential has no Conv/Linear/RNN weight"):
        paper.first_layer_weight(nn.Sequential(nn.BatchNorm1d(3)))


def test_model_setting_adapts_sizes():
    assert paper.model_setting("unet", 100) == (100, {"depth": 2})
    assert paper.model_setting("unet", 64) == (64, {})
    assert paper.model_setting("inception_v3", 64) == (75, {})
    assert paper.model_setting("vgg16", 16) == (32, {})
    assert paper.model_setting("resnet50", 64) == (64, {})


def test_short_reason_maps_known_torch_messages():
    err = RuntimeError("Batching rule not implemented for aten::foo.bar. We could not generate a fallback.")
    assert paper.short_reason(err) == "no vmap batching rule for aten::foo.bar"
    long = RuntimeError("x" * 200 + "\nsecond line")
    assert len(paper.short_reason(long)) == 60 and paper.short_reason(long).endswith("…")


def _cell(t, diff=None):
    c = {"status": "ok", "median": t, "mean": t}
    if diff is not None:
        c["max_rel_diff"] = diff
    return c


def test_summarize_row_excludes_disagreeing_alternatives():
    cells = {"clone": _cell(1.0), "fwd_2b": _cell(0.8), "func_jvp": _cell(1.5, 1e-7), "forward_ad": _cell(0.5, 0.3),
             "double_vjp": _cell(3.0, 1e-7)}
    s = paper.summarize_row(cells, "median", 1e-3)
    assert s["fastest"] == "func_jvp" and s["speedup"] == 1.5 and s["excluded"] == ["forward_ad"]
    assert s["clone_over_fwd2b"] == pytest.approx(1.25) and not s["clone_suspect"]
    cells["func_jvp"]["max_rel_diff"] = 0.2  # now most alternatives disagree: clone is the suspect
    s = paper.summarize_row(cells, "median", 1e-3)
    assert s["clone_suspect"] and s["speedup"] is None


def test_budget_lowers_repeats_but_keeps_two():
    s = paper.Settings(repeats=10, warmup=2, cell_budget=1.0)
    assert paper._budgeted(0.01, s) == (2, 10)
    assert paper._budgeted(0.2, s) == (1, 4)
    assert paper._budgeted(5.0, s) == (0, 2)


@pytest.mark.slow
def test_profile_row_lists_top_ops():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).eval()
    x = torch.randn(2, 3, 8, 8)
    prob = paper.Problem(model, "x", x, torch.randn_like(x), "0.weight", torch.randn(4, 3, 3, 3), torch.device("cpu"))
    prof = paper.profile_row(prob, paper.Settings(profile_iters=1))
    ops = {e["op"] for e in prof["clone_top"]} | {e["op"] for e in prof["fwd2b_top"]}
    assert any("conv" in op for op in ops) and prof["clone_self_ms"] > 0


def test_operators_benchmark_end_to_end(tmp_path):
    rc = operators.main(["--sizes", "8", "--batch-sizes", "2", "--repeats", "1", "--warmup", "0", "--quiet",
                         "--steady-malloc", "off",
                         "--out", str(tmp_path), "--name", "ops"])
    assert rc == 0
    result = json.loads((tmp_path / "ops.json").read_text())
    assert [r["op"] for r in result["records"]] == ["relu", "maxpool", "conv"]
    for r in result["records"]:
        assert "error" not in r and r["slowdown_vs_B"] > 0 and r["slowdown_vs_2B"] > 0
    assert result["machine"]["torch"] == torch.__version__
    assert (tmp_path / "ops.png").read_bytes()[:4] == b"\x89PNG"
    assert "| relu | 2 | 8 |" in (tmp_path / "ops.md").read_text()
    assert math.isfinite(result["summary"]["conv"]["2"]["vs_2B"])


@pytest.mark.slow
def test_from_json_rerenders_with_findings(grid, tmp_path):
    out, _ = grid
    (tmp_path / "tiny.json").write_text((out / "tiny.json").read_text())
    notes = tmp_path / "notes.md"
    notes.write_text("resnet50 misses the target because ...")
    assert paper.main(["--from-json", str(tmp_path / "tiny.json"), "--notes", str(notes), "--no-plot"]) == 0
    md = (tmp_path / "tiny.md").read_text()
    assert "## Findings" in md and "resnet50 misses the target because" in md
    assert md.startswith((out / "tiny.md").read_text().strip())  # same tables, findings appended
    assert json.loads((tmp_path / "tiny.json").read_text())["notes"].startswith("resnet50 misses")


def test_speedup_bound_is_fastest_agreeing_alternative_over_fwd2b():
    rows = [{"cells": {"clone": _cell(1.0), "fwd_2b": _cell(0.5), "func_jvp": _cell(2.0, 1e-7),
                       "forward_ad": _cell(0.1, 0.5)}},
            {"cells": {"clone": _cell(1.0), "fwd_2b": _cell(1.0), "func_jvp": _cell(2.0, 1e-7)}}]
    assert paper.speedup_bound(rows, "median", 1e-3) == pytest.approx(math.sqrt(4.0 * 2.0))


@pytest.mark.slow
def test_capture_benchmark_writes_ratios_and_checks_every_engine(tmp_path):
    from jvpreg.bench import capture

    out = tmp_path / "cap"
    assert capture.main(["--suites", "small", "--methods", "forward_2B,eager,captured", "--rounds", "2",
                         "--warmup", "1", "--burst", "2", "--threads", "1", "--out", str(out), "--no-progress"]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["meta"]["burst"] == 2 and "mean of 2 back-to-back calls" in out.with_suffix(".md").read_text()
    assert [r["model"] for r in result["rows"]] and all(r["captured/fwd2B"] > 0 for r in result["rows"])
    assert all(r["rel_diff"]["captured"] == 0.0 for r in result["rows"])  # the replay runs the recorded kernels
    ratios = [r["captured/fwd2B"] for r in result["rows"]]
    assert result["geomean"]["small: captured/fwd2B"] == pytest.approx(
        math.exp(sum(map(math.log, ratios)) / len(ratios)), rel=1e-12)
    assert f"small: captured/fwd2B: **{result['geomean']['small: captured/fwd2B']:.2f}**" in \
        out.with_suffix(".md").read_text()
    assert "| model" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_capture_benchmark_checks_against_the_eager_engine_also_when_it_is_not_timed():
    from jvpreg.bench import capture

    result = capture.run(["small"], ["forward_2B", "captured"], rounds=1, warmup=0, device="cpu", mode="eval",
                         autocast=None, progress=False, clock="cpu", isolate=False, threads=1)
    assert all(r["rel_diff"] == {"captured": 0.0} and "eager" not in r["times"] for r in result["rows"])


@pytest.mark.slow
def test_capture_benchmark_runs_each_model_in_a_fresh_process_when_isolated():
    """``isolate`` (the default with torch.compile methods): one spawned process per model, the parent's thread
    count applied there; the rows are those of an in-process run."""
    from jvpreg.bench import capture

    result = capture.run(["small"], ["forward_2B", "eager", "captured"], rounds=1, warmup=0, device="cpu", mode="eval",
                         autocast=None, progress=False, clock="cpu", isolate=True, threads=1)
    assert [r["model"] for r in result["rows"]] == list(capture.SUITES["small"])
    assert all(not r["errors"] and r["rel_diff"]["captured"] == 0.0 and r["captured/fwd2B"] > 0
               for r in result["rows"])


@pytest.mark.slow
def test_capture_benchmark_records_a_model_whose_process_failed_and_still_writes_its_table():
    from jvpreg.bench import capture

    result = capture.run(["norm"], ["forward_2B", "captured"], rounds=1, warmup=0, device="cuda:99", mode="eval",
                         autocast=None, progress=False, isolate=True)
    (row,) = result["rows"]
    assert list(row["errors"]) == ["process"] and row["shape"] == list(capture.SUITES["norm"]["resnet18_gn"][1])
    meta = {"device": "cuda:99", "mode": "eval", "autocast": None, "command": "c", "load": "n/a", "rounds": 1,
            "warmup": 0, "burst": 1, "methods": ["forward_2B", "captured"], "clock": "wall", "isolated": True,
            "machine": {"cpu": "cpu", "cpu_cores": 1, "torch_threads": 1, "gpu": None, "torch": torch.__version__}}
    assert "failures: process:" in capture.to_markdown(result, meta)


@pytest.mark.slow
def test_capture_benchmark_runs_the_autodiff_methods_on_unfused_attention():
    """torch's fused attention (the eval-mode ``nn.MultiheadAttention`` fast path) has no forward AD: the autodiff
    methods run on the math path, as a torch.func user would, agree with the clone JVP, and leave the flags as found."""
    from jvpreg.bench import capture

    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x, u = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    with torch.no_grad(), pytest.raises(Exception, match="forward AD"):
        torch.func.jvp(model, (x,), (u,))  # the fused path: what the wrapper exists for
    fns = capture.method_fns(model, x, u, ["captured", "torch.func.jvp", "forward_ad"])
    with torch.no_grad():
        ref = fns["captured"]()[1]
        for method in ("torch.func.jvp", "forward_ad"):
            torch.testing.assert_close(fns[method]()[1], ref, rtol=1e-4, atol=1e-5)
    assert torch.backends.mha.get_fastpath_enabled()


def test_capture_benchmark_refuses_a_burst_below_one(capsys):
    from jvpreg.bench import capture

    with pytest.raises(SystemExit):
        capture.main(["--burst", "0"])
    assert "--burst: expected a positive number of calls, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_train_benchmark_writes_time_and_memory_ratios(tmp_path):
    from jvpreg.bench import train

    out = tmp_path / "train"
    assert train.main(["--models", "mlp:8", "--methods", "plain,plain_2b,clone,double_backprop", "--repeats", "2",
                       "--warmup", "1", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {r["method"]: r for r in result["results"]}
    assert rows["plain"]["vs_plain"] == 1.0 and rows["clone"]["vs_plain"] > 0
    # the floor: the plain step on the doubled batch, and the most double backprop's lead can be
    assert rows["plain_2b"]["vs_plain_2b"] == 1.0 and rows["plain_2b"]["saved_vs_plain"] > 1.5
    (db,) = [t for t in result["targets"] if t["target"].startswith("double backprop")]
    assert db["bound"] == rows["double_backprop"]["vs_plain_2b"]
    assert "the most any method that runs the 2B-row" in out.with_suffix(".md").read_text()
    # the clone step keeps the 2B-row batch's activations: more than the plain step, and deterministic
    assert rows["clone"]["saved_vs_plain"] > 1.0
    assert train.saved_for_backward(train.Step("plain", *_mlp_batch(train))) == rows["plain"]["saved_bytes"]
    assert "saved vs plain" in out.with_suffix(".md").read_text()
    if rows["plain"]["live_bytes"] is not None:  # None where torch's profiler has no memory timeline
        assert rows["clone"]["live_vs_plain"] > 1.0 and "live vs plain" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_train_benchmark_compares_double_backprop_with_the_compiled_engine(tmp_path):
    """torch.compile has no double backward, so double backprop's best is eager: the row of the compiled attempt
    records torch's refusal, and the target compares eager double backprop with the compiled clone step."""
    from jvpreg.bench import train

    out = tmp_path / "train"
    assert train.main(["--models", "mlp:8", "--methods", "plain,clone,clone_compiled,double_backprop,"
                       "double_backprop_compiled", "--repeats", "2", "--warmup", "1", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {r["method"]: r for r in result["results"]}
    assert rows["double_backprop_compiled"]["status"] != "ok"
    assert "double backward" in rows["double_backprop_compiled"]["error"]
    (t,) = [t for t in result["targets"] if t["target"] == "double backprop >= 1.5x compiled clone step"]
    assert t["value"] == pytest.approx(rows["double_backprop"]["median_s"] / rows["clone_compiled"]["median_s"])
    md = out.with_suffix(".md").read_text()
    assert "nan" not in md  # no plain_2b in this run: its ratio cells are empty


@pytest.mark.slow
def test_train_benchmark_autocast_runs_each_steps_forward_in_bfloat16(tmp_path):
    """``--autocast bf16``: the forward and penalty of every method under torch.autocast (the GPU tables' bf16 rows),
    so each step keeps bfloat16 activations for backward; the gradient check stays in float64."""
    from jvpreg.bench import train

    batch = _mlp_batch(train)
    for method in ("plain", "clone", "double_backprop"):
        full, half = train.Step(method, *batch), train.Step(method, *batch, autocast=torch.bfloat16)
        with half.amp():
            assert half.model(half.x).dtype == torch.bfloat16
        assert torch.isfinite(half()) and half.model[1].weight.grad.dtype == torch.float32  # float32 weights
        for step, dtype in ((full, torch.float32), (half, torch.bfloat16)):  # what backward keeps
            dtypes = set()
            with torch.autograd.graph.saved_tensors_hooks(lambda t: dtypes.add(t.dtype) or t, lambda t: t):
                with step.amp():
                    step.loss(step.model, step.shared, step.random_penalty)
            assert (torch.bfloat16 in dtypes) == (dtype == torch.bfloat16), (method, dtypes)
    out = tmp_path / "train"
    assert train.main(["--models", "mlp:8", "--methods", "plain,clone,clone_eager", "--repeats", "1", "--warmup",
                       "1", "--autocast", "bf16", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["autocast"] == "bf16" and "under `torch.autocast` (bf16)" in out.with_suffix(".md").read_text()
    assert {r["method"]: r["grad_check"] for r in result["results"] if "grad_check" in r} == {"clone_eager": "ok"}


def test_peak_live_bytes_counts_a_temporary_and_not_what_was_live_before():
    from jvpreg.bench.memory import peak_live_bytes

    held = torch.ones(1 << 20)  # live before: not counted

    def fn():
        tmp = torch.ones(1 << 18) * 2  # 1 MiB live at once (two of them), then freed
        return float(tmp.sum()) + float(held[0])

    peak = peak_live_bytes(fn)
    if peak is None:
        pytest.skip("this torch's profiler has no memory timeline")
    assert 2 ** 20 <= peak <= 2 ** 21 + 2 ** 16, peak


def _mlp_batch(train):
    torch.manual_seed(0)
    model, shape = train.build("mlp")
    x = torch.randn(8, *shape)
    return model, x, torch.randint(0, 10, (8,)), torch.randn_like(x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where torch sees no CUDA device")
def test_train_benchmark_refuses_a_cuda_device_it_cannot_see():
    from jvpreg.bench import train

    with pytest.raises(SystemExit):
        train.main(["--device", "cuda", "--models", "mlp:8", "--out", ""])


def test_train_benchmark_checkpoints_blocks_and_the_clone_step_keeps_its_gradients():
    """``--checkpoint-blocks``: every transformer block under torch.utils.checkpoint; the clone step's gradients
    equal those of the same step without checkpointing (and an MLP, with no block, is refused by name)."""
    from jvpreg.bench import train

    model, shape = train.build("vit")
    wrapped = copy.deepcopy(model)
    assert train.checkpoint_blocks(wrapped) == 4
    assert sum(isinstance(m, train.Checkpointed) for m in wrapped.modules()) == 4
    torch.manual_seed(0)
    x, y = torch.randn(2, *shape), torch.randint(0, 10, (2,))
    u = torch.randn_like(x)
    grads = []
    for m in (model, wrapped):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # JVPCaptureWarning: checkpointed blocks run in eager clone mode
            step = train.Step("clone", m, x, y, u)
            grads.append(step.gradient())
    for (name, g), g_ckpt in zip(grads[0].items(), grads[1].values()):
        torch.testing.assert_close(g_ckpt, g, rtol=1e-12, atol=1e-14, msg=name)  # float64
    with pytest.raises(ValueError, match="checkpoint-blocks"):
        train.checkpoint_blocks(train.build("mlp")[0])


@pytest.mark.slow
def test_train_benchmark_interrupted_in_its_gradient_checks_still_writes_its_timings(tmp_path, monkeypatch):
    """A time limit's SIGINT while the float64 gradient checks run (the compiled engine recompiles for them: on an
    H100 the ViT's table was lost so) ends the run with 130, after the tables with every timing measured."""
    from jvpreg.bench import train

    calls = []
    real = train.Step.gradient

    def gradient(self):
        calls.append(self.method)
        if len(calls) > 1:  # the clone reference ran; the first check is interrupted
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(train.Step, "gradient", gradient)
    out = tmp_path / "train"
    assert train.main(["--models", "mlp:8,mlp200:8", "--methods", "plain,clone,clone_eager", "--repeats", "1",
                       "--warmup", "1", "--out", str(out)]) == 130
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {r["method"]: r for r in result["results"]}
    assert {r["model"] for r in result["results"]} == {"mlp"}  # stopped after the interrupted model
    assert all(r["status"] == "ok" and r["median_s"] > 0 for r in rows.values())
    assert rows["clone_eager"]["grad_check"] == train.INTERRUPTED
    assert "grad check: not run (interrupted)" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_capture_benchmark_runs_the_neural_operator():
    """FNO-2d as its reference code is written (complex weights, modes written into ``torch.zeros``): the captured
    engine replays the eager one's JVP exactly, and torch.func.jvp agrees to float32 rounding."""
    from jvpreg.bench import capture

    result = capture.run(["operator"], ["forward_2B", "captured", "torch.func.jvp"], rounds=1, warmup=0, device="cpu",
                         mode="eval", autocast=None, progress=False, clock="cpu", isolate=False, threads=1)
    (row,) = result["rows"]
    assert row["model"] == "fno2d" and not row["errors"]
    assert row["rel_diff"]["captured"] == 0.0 and row["rel_diff"]["torch.func.jvp"] < 1e-5
