"""scripts/ci_durations.py: a pytest --durations=0 log summed by file and by test function."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import ci_durations  # noqa: E402

LOG = """\
============================= slowest durations ==============================
12.50s call     tests/a.py::test_x[one]
0.50s setup    tests/a.py::test_x[one]
7.00s call     tests/a.py::test_x[two]
30.00s call     tests/b.py::test_y
0.01s teardown tests/b.py::test_y
12 passed in 55.20s
"""


def test_sums_setup_call_and_teardown_by_test():
    assert ci_durations.parse(LOG.splitlines()) == {"tests/a.py::test_x[one]": 13.0,
                                                      "tests/a.py::test_x[two]": 7.0, "tests/b.py::test_y": 30.01}


def test_groups_by_file_and_function_largest_first():
    d = ci_durations.parse(LOG.splitlines())
    assert ci_durations.group(d, ci_durations.by_file) == [("tests/b.py", 30.01, 1), ("tests/a.py", 20.0, 2)]
    assert ci_durations.group(d, ci_durations.by_function)[1] == ("tests/a.py::test_x", 20.0, 2)


def test_prints_the_tables_and_refuses_a_log_without_durations(tmp_path):
    log = tmp_path / "d.log"
    log.write_text(LOG)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "ci_durations.py"), str(log)],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("3 tests, 0.8 min summed, 0.9 min wall")
    assert out.index("tests/b.py") < out.index("tests/a.py ")
    log.write_text("12 passed in 55.20s\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "ci_durations.py"), str(log)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "run pytest with --durations=0" in proc.stderr
