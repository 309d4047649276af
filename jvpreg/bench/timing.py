"""Timing helpers shared by the benchmarks: medians over repeats, device sync, machine description."""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable, Dict

import torch


def sync(device: torch.device | str) -> None:
    """Wait for queued kernels (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], *, repeats: int = 10, warmup: int = 2, device: str | torch.device = "cpu") -> Dict[str, float]:
    """Run ``fn`` ``warmup`` times, then time ``repeats`` runs; seconds as median/mean/std/min."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return {
        "median": statistics.median(times),
        "mean": statistics.fmean(times),
        "std": statistics.pstdev(times) if len(times) > 1 else 0.0,
        "min": min(times),
        "repeats": repeats,
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(device: str | torch.device = "cpu") -> Dict[str, object]:
    """CPU model, core count, GPU name, torch version: what a results file must name."""
    dev = torch.device(device)
    return {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "device": str(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


