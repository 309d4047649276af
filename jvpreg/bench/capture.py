"""``python -m jvpreg.bench capture``: the clone engines (eager, captured, compiled) against the plain 2B forward.

Side by side in one process, per model: the plain forward of the B and 2B-row batches (the
physical limit of a clone JVP is the 2B forward), ``jvpreg.jvp`` with ``engine="eager"``,
``"captured"`` and ``"compiled"``, the ``torch.compile``-d 2B forward (the limit for the compiled
engine, compiled with the same Inductor options: :func:`jvpreg.clone.program.capture.inductor_options`), ``torch.func.jvp``, forward-mode AD, and ``torch.compile(torch.func.jvp)``. Repeats are
*interleaved* (one run of every method per round, in a fresh random order each round), so slow drifts
of a shared machine hit every method alike and no method always runs right after the one that warmed
its caches (``forward_B`` before ``forward_2B`` ran the same code on the same weights: a fixed order
favoured the 2B forward on the sub-millisecond models); times are medians over rounds. Every method's JVP is checked against the eager clone
engine once, and a method that fails is recorded as failing (the run goes on). The autodiff methods run with
attention unfused (``nn.MultiheadAttention``'s fast path off, SDPA's math kernel: torch's fused attention has no
forward AD, so a ViT fails otherwise); the clone engines and the plain forwards keep the fused kernels.

Suites: ``small`` (the four small-op models of the captured-clone issue), ``rnn`` (the paper's
row-by-row Elman RNN, a 2-layer LSTM and a GRU on 8-step sequences, and the LSTM and GRU on packed sequences of
lengths 8, 6, 5 and 3), ``large`` (ResNet-50, VGG-16,
DenseNet-121 at batch 8, 64x64) and ``gpu`` (ResNet-50, ViT-B/16, DenseNet-121 at batch 32, 224x224).
"""
from __future__ import annotations

import argparse
import random
import sys
import warnings
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

import jvpreg
from jvpreg.bench.report import command_line, geo_mean, load_average, md_table, steady_malloc, write_results
from jvpreg.bench.timing import machine_description, sync
from jvpreg.clone.program.capture import inductor_options

METHODS = ("forward_B", "forward_2B", "eager", "captured", "compiled_forward_2B", "compiled",
           "torch.func.jvp", "forward_ad", "compiled_torch.func.jvp")
#: ``compiled_forward_2B_default``: the 2B forward under ``torch.compile``'s default Inductor options (what a user's
#: ``torch.compile(model)`` runs); ``compiled_forward_2B`` and ``compiled_torch.func.jvp`` use the compiled engine's
#: (:func:`jvpreg.clone.program.capture.inductor_options`), so the ratios compare like with like.
OPTIONAL_METHODS = ("compiled_forward_2B_default",)
COMPILE_METHODS = ("compiled_forward_2B", "compiled", "compiled_torch.func.jvp", "compiled_forward_2B_default")


class _Recurrent(nn.Module):
    """A 2-layer LSTM or GRU over a short sequence, then a linear head."""

    def __init__(self, cell: type, features: int = 32, hidden: int = 64):
        super().__init__()
        self.rnn = cell(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class _PackedRecurrent(_Recurrent):
    """:class:`_Recurrent` on a packed batch of sequences of lengths 8, 6, 5 and 3 (repeated for a doubled batch):
    the final hidden state of each sequence, then the head."""

    def forward(self, x):
        lengths = torch.tensor([8, 6, 5, 3]).repeat(x.shape[0] // 4)
        state = self.rnn(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))[1]
        return self.head((state[0] if isinstance(state, tuple) else state)[-1])


def _mlp():
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(20)])


def _tv(name: str, **kw) -> Callable[[], nn.Module]:
    def build():
        import torchvision

        return getattr(torchvision.models, name)(**kw)
    return build


def vit_small():
    """The small-op suite's ViT: 4 layers of width 64 on 32x32 images in 8x8 patches, its head random."""
    import torchvision

    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=4, num_heads=4, hidden_dim=64,
                                                 mlp_dim=128, num_classes=10)
    return random_head(model)


def random_head(model: nn.Module) -> nn.Module:
    """torchvision's ViTs start with a zero head (every JVP is 0): give it random weights."""
    nn.init.normal_(model.heads.head.weight, std=0.02)
    return model


def _row_rnn():
    from jvpreg.models import build_model

    return build_model("rnn", in_channels=1, num_classes=10, image_size=28)


def _resnet18_gn():
    """ResNet-18 with GroupNorm(32) in place of BatchNorm (the norm of detection heads and small-batch training)."""
    import torchvision

    return torchvision.models.resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(32, c))


class _SpectralConv2d(nn.Module):
    """A Fourier neural operator's spectral convolution as its reference code writes it: the retained modes written
    into ``torch.zeros`` of the batch size (:mod:`jvpreg.clone.eager.made_tensors`), complex weights."""

    def __init__(self, width: int, modes: int):
        super().__init__()
        self.modes = modes
        scale = 1 / (width * width)
        self.w1 = nn.Parameter(scale * torch.rand(width, width, modes, modes, dtype=torch.cfloat))
        self.w2 = nn.Parameter(scale * torch.rand(width, width, modes, modes, dtype=torch.cfloat))

    def forward(self, x):
        m = self.modes
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(x.shape[0], self.w1.shape[1], x.size(-2), x.size(-1) // 2 + 1, dtype=x_ft.dtype,
                             device=x.device)
        out_ft[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], self.w1)
        out_ft[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m:, :m], self.w2)
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


class _FNO2d(nn.Module):
    """FNO-2d (Li et al. 2021): lift, 4 Fourier layers (spectral conv + 1x1 conv, GELU), project."""

    def __init__(self, width: int = 32, modes: int = 8, layers: int = 4):
        super().__init__()
        self.lift, self.project = nn.Conv2d(1, width, 1), nn.Conv2d(width, 1, 1)
        self.spectral = nn.ModuleList([_SpectralConv2d(width, modes) for _ in range(layers)])
        self.pointwise = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(layers)])

    def forward(self, x):
        x = self.lift(x)
        for i, (s, w) in enumerate(zip(self.spectral, self.pointwise)):
            x = s(x) + w(x)
            x = nn.functional.gelu(x) if i < len(self.spectral) - 1 else x
        return self.project(x)


# name -> (builder, input shape)
SUITES: Dict[str, Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...]]]] = {
    "small": {
        "mlp20x64": (_mlp, (4, 64)),
        "resnet18": (_tv("resnet18", num_classes=10), (1, 3, 32, 32)),
        "mobilenet_v3_small": (_tv("mobilenet_v3_small", num_classes=10), (1, 3, 32, 32)),
        "vit_4x64": (vit_small, (2, 3, 32, 32)),
    },
    "rnn": {
        "row_rnn": (_row_rnn, (4, 1, 28, 28)),
        "lstm2": (lambda: _Recurrent(nn.LSTM), (4, 8, 32)),
        "gru2": (lambda: _Recurrent(nn.GRU), (4, 8, 32)),
        "lstm2_packed": (lambda: _PackedRecurrent(nn.LSTM), (4, 8, 32)),
        "gru2_packed": (lambda: _PackedRecurrent(nn.GRU), (4, 8, 32)),
    },
    "norm": {  # GroupNorm: its statistics are per sample, so its rule has work to do in eval mode too
        "resnet18_gn": (_resnet18_gn, (4, 3, 32, 32)),
    },
    "operator": {  # complex intermediates, and tensors the forward makes and fills
        "fno2d": (_FNO2d, (4, 1, 32, 32)),
    },
    "large": {
        "resnet50": (_tv("resnet50"), (8, 3, 64, 64)),
        "vgg16": (_tv("vgg16"), (8, 3, 64, 64)),
        "densenet121": (_tv("densenet121"), (8, 3, 64, 64)),
    },
    "gpu": {
        "resnet50": (_tv("resnet50"), (32, 3, 224, 224)),
        "vit_b_16": (lambda: random_head(_tv("vit_b_16")()), (32, 3, 224, 224)),
        "densenet121": (_tv("densenet121"), (32, 3, 224, 224)),
    },
}


def _forward_ad(model, x, u):
    from torch.autograd import forward_ad as fwAD

    with fwAD.dual_level():
        return fwAD.unpack_dual(model(fwAD.make_dual(x, u)))


def on_math_attention(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with attention on its unfused path: ``nn.MultiheadAttention``'s eval-mode fast path off and
    scaled-dot-product attention on its math kernel. torch's fused attention kernels have no forward AD, so this is
    how a ``torch.func.jvp`` user gets a ViT to run at all; the clone engines keep the fused kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        fast = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            with sdpa_kernel(SDPBackend.MATH):
                return fn()
        finally:
            torch.backends.mha.set_fastpath_enabled(fast)
    return run


def method_fns(model: nn.Module, x: torch.Tensor, u: torch.Tensor, methods) -> Dict[str, Callable[[], object]]:
    """One zero-argument callable per method; each returns ``(y, Ju)`` or the forward's output. The autodiff
    methods run with attention unfused (:func:`on_math_attention`)."""
    x2 = torch.cat([x, x])
    fns: Dict[str, Callable[[], object]] = {
        "forward_B": lambda: model(x),
        "forward_2B": lambda: model(x2),
        "eager": lambda: jvpreg.jvp(model, (x,), (u,), engine="eager"),
        "captured": lambda: jvpreg.jvp(model, (x,), (u,), engine="captured"),
        "compiled": lambda: jvpreg.jvp(model, (x,), (u,), engine="compiled"),
        "torch.func.jvp": on_math_attention(lambda: torch.func.jvp(model, (x,), (u,))),
        "forward_ad": on_math_attention(lambda: _forward_ad(model, x, u)),
    }
    options = inductor_options(x.device.type)  # the compiled engine's Inductor options, for a like-for-like ratio
    if "compiled_forward_2B" in methods:
        compiled_model = torch.compile(model, dynamic=False, options=options)
        fns["compiled_forward_2B"] = lambda: compiled_model(x2)
    if "compiled_forward_2B_default" in methods:
        default_model = torch.compile(model, dynamic=False)
        fns["compiled_forward_2B_default"] = lambda: default_model(x2)
    if "compiled_torch.func.jvp" in methods:
        cj = torch.compile(lambda a, b: torch.func.jvp(model, (a,), (b,)), dynamic=False, options=options)
        fns["compiled_torch.func.jvp"] = on_math_attention(lambda: cj(x, u))
    return {m: fns[m] for m in methods}


def _jvp_of(result) -> torch.Tensor | None:
    return result[1] if isinstance(result, tuple) and len(result) == 2 else None


def bench_model(name: str, model: nn.Module, x: torch.Tensor, methods, rounds: int, warmup: int,
                autocast: torch.dtype | None, clock: str = "wall", burst: int = 1) -> dict:
    """Interleaved medians (seconds per call) of every method on one model, plus the JVP check. Each round
    times ``burst`` back-to-back calls of each method: 1 measures a call that follows other work (cold caches,
    as in a training step); more measure a call that follows itself."""
    device = x.device
    u = torch.randn_like(x)
    fns = method_fns(model, x, u, methods)
    ctx = (lambda: torch.autocast(device.type, dtype=autocast)) if autocast else None
    row = {"model": name, "times": {}, "errors": {}, "rel_diff": {}}
    live: Dict[str, Callable[[], object]] = {}
    ref = None
    if "eager" not in fns:  # the reference of the check, untimed
        with torch.no_grad(), (ctx() if ctx else _null()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            ref = _jvp_of(jvpreg.jvp(model, (x,), (u,), engine="eager"))
    for meth, fn in fns.items():  # first call: captures / compiles, checks, warms up
        try:
            with torch.no_grad(), (ctx() if ctx else _null()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                jv = _jvp_of(fn())
                if meth == "eager":
                    ref = jv
                elif jv is not None and ref is not None:
                    row["rel_diff"][meth] = float((jv.float() - ref.float()).norm() / ref.float().norm())
                for _ in range(warmup):
                    fn()
            live[meth] = fn
        except Exception as err:  # recorded, never fatal
            row["errors"][meth] = f"{type(err).__name__}: {str(err).splitlines()[0][:140] if str(err) else ''}"
    times: Dict[str, List[float]] = {m: [] for m in live}
    import time

    now = time.process_time if clock == "cpu" else time.perf_counter
    order = random.Random(0)
    for _ in range(rounds):  # a fresh order each round: no method always runs right after its twin
        for meth, fn in order.sample(list(live.items()), len(live)):
            if meth not in live:
                continue
            with torch.no_grad(), (ctx() if ctx else _null()):
                sync(device)
                t0 = now()
                try:
                    for _ in range(burst):
                        fn()
                except Exception as err:  # e.g. a recompilation that crashes: recorded, never fatal
                    row["errors"][meth] = f"{type(err).__name__} (timed run): {str(err).splitlines()[0][:140]}"
                    del live[meth], times[meth]
                    continue
                sync(device)
                times[meth].append((now() - t0) / burst)
    import statistics

    row["times"] = {m: statistics.median(v) for m, v in times.items()}
    t = row["times"]
    for meth in ("eager", "captured"):
        if t.get(meth) and t.get("forward_2B"):
            row[f"{meth}/fwd2B"] = t[meth] / t["forward_2B"]
    if t.get("compiled") and t.get("compiled_forward_2B"):
        row["compiled/compiled_fwd2B"] = t["compiled"] / t["compiled_forward_2B"]
    alts = [t[m] for m in ("torch.func.jvp", "forward_ad", "compiled_torch.func.jvp") if t.get(m)]
    best = min((t[m] for m in ("captured", "compiled") if t.get(m)), default=None)
    if alts and best:
        row["fastest_autodiff/best_clone"] = min(alts) / best
    return row


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _model_row(suite: str, name: str, methods, rounds: int, warmup: int, device: str, mode: str, autocast,
               clock: str, batch_size: int | None, burst: int) -> dict:
    """One model's row: built, seeded and benchmarked (:func:`bench_model`)."""
    build, shape = SUITES[suite][name]
    torch.manual_seed(0)
    model = build().to(device)
    model.train(mode == "train")
    for p in model.parameters():
        p.requires_grad_(False)
    if batch_size:
        shape = (batch_size, *shape[1:])
    x = torch.randn(*shape, device=device)
    row = bench_model(name, model, x, methods, rounds, warmup, autocast, clock, burst)
    row["suite"], row["shape"] = suite, list(shape)
    return row


def _isolated_row(args: tuple, threads: int | None, steady: bool) -> dict:
    """:func:`_model_row` in a fresh process (the process settings of the parent applied first)."""
    if threads:
        torch.set_num_threads(threads)
    if steady:
        steady_malloc()
    return _model_row(*args)


def run(suites, methods, rounds: int, warmup: int, device: str, mode: str, autocast, progress: bool,
        clock: str = "wall", batch_size: int | None = None, burst: int = 1, isolate: bool = False,
        threads: int | None = None, steady: bool = False) -> dict:
    """Every model of ``suites``; with ``isolate`` each in a fresh process: a ``torch.compile``-d
    ``torch.func.jvp`` can leave the process in a state where every later ``torch.func.jvp`` fails with
    ``InferenceMode::is_enabled() && primal.is_inference() ... INTERNAL ASSERT FAILED`` and tracing loses track of
    tensors (seen on this CPU with torch 2.15 after compiling ResNet-18 and its ``torch.func.jvp``; whether it
    happens depends on the Inductor cache), which would fail every method of the models after it."""
    from tqdm.auto import tqdm

    specs = [(s, n) for s in suites for n in SUITES[s]]
    rows = []
    if isolate:
        import concurrent.futures
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        for suite, name in tqdm(specs, desc="bench capture", disable=not progress):
            args = (suite, name, methods, rounds, warmup, device, mode, autocast, clock, batch_size, burst)
            with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                try:
                    rows.append(pool.submit(_isolated_row, args, threads, steady).result())
                except Exception as err:  # noqa: BLE001 - a crashed process: recorded, never fatal
                    shape = SUITES[suite][name][1]
                    rows.append({"model": name, "suite": suite, "times": {}, "rel_diff": {},
                                 "shape": [batch_size or shape[0], *shape[1:]],
                                 "errors": {"process": f"{type(err).__name__}: {str(err)[:200]}"}})
    else:
        for suite, name in tqdm(specs, desc="bench capture", disable=not progress):
            rows.append(_model_row(suite, name, methods, rounds, warmup, device, mode, autocast, clock, batch_size,
                                   burst))
            if device != "cpu":
                torch.cuda.empty_cache()
    summary = {}
    for suite in suites:
        rs = [r for r in rows if r["suite"] == suite]
        for key in ("eager/fwd2B", "captured/fwd2B", "compiled/compiled_fwd2B", "fastest_autodiff/best_clone"):
            summary[f"{suite}: {key}"] = geo_mean(r.get(key) for r in rs)
    return {"rows": rows, "geomean": summary}


def to_markdown(result: dict, meta: dict) -> str:
    methods = meta["methods"]
    lines = [f"# Clone engines side by side ({meta['device']}, {meta['mode']} mode"
             + (f", {meta['autocast']} autocast" if meta["autocast"] else "") + ")", "",
             f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine']['cpu']} ({meta['machine']['cpu_cores']} cores, torch threads "
             f"{meta['machine']['torch_threads']}), GPU: {meta['machine']['gpu'] or 'none'}, torch "
             f"{meta['machine']['torch']}; load average before the run: {meta['load']}  ",
             f"Medians of {meta['rounds']} interleaved rounds (methods in a fresh random order each round) after "
             f"{meta['warmup']} warm-up runs ({meta['clock']} clock"
             + ("; each model in a fresh process" if meta.get("isolated") else "") + "); "
             + ("each time is one call, which follows other methods' work (cold caches); "
                if meta.get("burst", 1) == 1 else
                f"each time is the mean of {meta['burst']} back-to-back calls (warm caches); ")
             + "times in ms; float32."
             + (f" The compiled methods use the compiled engine's Inductor options ({meta['inductor_options']}; "
                "`compiled_forward_2B_default`: torch.compile's defaults)." if meta.get("inductor_options") else ""),
             ""]
    headers = ["model", "input"] + list(methods) + ["eager / fwd 2B", "captured / fwd 2B",
                                                    "compiled / compiled fwd 2B", "fastest autodiff / best clone"]
    table = []
    for r in result["rows"]:
        t = r["times"]
        cells = [r["model"], "x".join(map(str, r["shape"]))]
        cells += [f"{t[m] * 1e3:.3f}" if t.get(m) else "fails" for m in methods]
        for key in ("eager/fwd2B", "captured/fwd2B", "compiled/compiled_fwd2B", "fastest_autodiff/best_clone"):
            cells.append(f"{r[key]:.2f}" if r.get(key) else "-")
        table.append(cells)
    lines.append(md_table(headers, table))
    lines += ["", "Geometric means:", ""]
    lines += [f"- {k}: **{v:.2f}**" for k, v in result["geomean"].items() if v == v]
    lines += ["", "Relative difference of each method's JVP to the eager clone engine's, and failures:", ""]
    for r in result["rows"]:
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in r["rel_diff"].items())
        errs = "; ".join(f"{k}: {v}" for k, v in r["errors"].items())
        lines.append(f"- {r['model']}: {diffs}" + (f"; failures: {errs}" if errs else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m jvpreg.bench capture", description=__doc__.splitlines()[0])
    ap.add_argument("--suites", default="small,rnn,large", help=f"comma-separated, of {', '.join(SUITES)}")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of " + ", ".join(METHODS + OPTIONAL_METHODS))
    ap.add_argument("--no-compile", action="store_true", help="drop the torch.compile methods (minutes of compiling)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--burst", type=int, default=1,
                    help="back-to-back calls timed per method and round (1: each call follows other methods' work)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", choices=("eval", "train"), default="eval")
    ap.add_argument("--autocast", choices=("none", "bf16"), default="none")
    ap.add_argument("--batch-size", type=int, default=None, help="override every model's batch size")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall clock, or process CPU time (steadier on a shared CPU; use with --threads 1)")
    ap.add_argument("--steady-malloc", action="store_true", help="never-trimmed heap (no page-fault noise on CPU)")
    ap.add_argument("--out", default="experiments/results/bench_capture_{device}", help="output prefix (.md, .json)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-isolate", action="store_true",
                    help="run every model in this process (by default each runs in a fresh one when torch.compile "
                         "methods are included: a compiled torch.func.jvp can break the models after it)")
    args = ap.parse_args(argv)
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [s for s in suites if s not in SUITES] + [m for m in methods if m not in METHODS + OPTIONAL_METHODS]
    if bad:
        ap.error(f"unknown suite or method: {', '.join(bad)}")
    if args.no_compile:
        methods = [m for m in methods if m not in COMPILE_METHODS]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steady_malloc:
        steady_malloc()
    autocast = torch.bfloat16 if args.autocast == "bf16" else None
    load = load_average()
    if args.burst < 1:
        ap.error(f"--burst: expected a positive number of calls, got {args.burst}")
    isolate = not args.no_isolate and any(m in COMPILE_METHODS for m in methods)
    result = run(suites, methods, args.rounds, args.warmup, args.device, args.mode, autocast, not args.no_progress,
                 args.clock, args.batch_size, args.burst, isolate=isolate, threads=args.threads,
                 steady=args.steady_malloc)
    meta = {"command": command_line("python -m jvpreg.bench capture", argv), "machine": machine_description(args.device),
            "device": args.device, "mode": args.mode, "autocast": args.autocast if autocast else None,
            "rounds": args.rounds, "warmup": args.warmup, "burst": args.burst, "methods": methods, "clock": args.clock,
            "inductor_options": (inductor_options(args.device) or "torch.compile's defaults")
            if any(m in COMPILE_METHODS for m in methods) else None,
            "isolated": isolate,
            "load": ", ".join(f"{v:.2f}" for v in load) if load else "n/a"}
    md = to_markdown(result, meta)
    print(md)
    paths = write_results(args.out.format(device=torch.device(args.device).type), md, {"meta": meta, **result})
    print("wrote " + " and ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
