"""Check that each OpInfo sweep collects the number of cases recorded for this torch (run by ``.ci/run`` before pytest).

A sweep parametrized over PyTorch's op database can shrink silently: a missing test dependency (``expecttest``,
which ``torch.testing._internal`` needs), an op database that fails to import, or a filter that drops ops would
collect fewer cases, or none, and the run would still pass. This collects the sweep files with
``pytest --collect-only -q --slow`` and compares the cases of each recorded test function with
``scripts/sweep_counts.json`` (by torch ``major.minor``: the op database changes between releases):

* a recorded torch: the counts must be equal;
* another torch: each sweep must collect at least ``MIN_FRACTION`` of the smallest count recorded for it (a new op
  database; record it with ``--record``).

``python scripts/check_sweep_counts.py``: check (exit 1 with the differences); ``--record``: write this torch's
counts into the JSON (commit it).
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COUNTS = ROOT / "scripts" / "sweep_counts.json"
SWEEP_FILES = ["tests/clone/test_opinfo_sweep.py"]
MIN_FRACTION = 0.9


def collected(files=SWEEP_FILES) -> dict:
    """``{"file::function": number of collected cases}`` of ``files`` (all of them: ``--slow``)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--slow", "-p", "no:cacheprovider",
                           *files], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"check_sweep_counts: collecting {' '.join(files)} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    counts = collections.Counter(line.split("[")[0] for line in proc.stdout.splitlines() if "::" in line)
    return dict(sorted(counts.items()))


def torch_version() -> str:
    import torch

    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def problems(got: dict, recorded: dict, version: str) -> list:
    """What is wrong with ``got`` against ``recorded`` (``{torch version: {test: count}}``)."""
    tests = sorted({t for counts in recorded.values() for t in counts})
    if not tests:
        return [f"{COUNTS.name} records no sweep"]
    if version in recorded:
        want = recorded[version]
        return [f"{t}: collected {got.get(t, 0)} cases, {want[t]} recorded for torch {version}"
                for t in tests if got.get(t, 0) != want.get(t, 0)]
    out = []
    for t in tests:
        least = min(counts[t] for counts in recorded.values() if t in counts)
        if got.get(t, 0) < MIN_FRACTION * least:
            out.append(f"{t}: collected {got.get(t, 0)} cases, fewer than {MIN_FRACTION:.0%} of the {least} recorded "
                       f"(torch {', '.join(sorted(recorded))}; this is torch {version})")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="write this torch's counts into sweep_counts.json")
    args = parser.parse_args(argv)
    recorded = json.loads(COUNTS.read_text()) if COUNTS.exists() else {}
    got, version = collected(), torch_version()
    if args.record:
        keep = sorted({t for counts in recorded.values() for t in counts}) or [t for t, n in got.items() if n > 1]
        recorded[version] = {t: got.get(t, 0) for t in keep}
        COUNTS.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")
        print(f"check_sweep_counts: recorded torch {version}: {recorded[version]}")
        return 0
    bad = problems(got, recorded, version)
    if bad:
        print("check_sweep_counts: an OpInfo sweep collects other cases than recorded (a missing test dependency, an "
              "op database that fails to load, a filter?); if intended, run python scripts/check_sweep_counts.py "
              "--record and commit scripts/sweep_counts.json:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    note = "" if version in recorded else f" (torch {version} not recorded: at least {MIN_FRACTION:.0%} of the least)"
    print(f"check_sweep_counts: {sum(got.get(t, 0) for t in {t for c in recorded.values() for t in c})} cases in "
          f"{len({t for c in recorded.values() for t in c})} sweeps as recorded{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
