"""scripts/check_sweep_counts.py (run by .ci/run before pytest): a sweep that collects other cases than recorded fails."""
from conftest import load_script

check = load_script("check_sweep_counts")
RECORDED = {"2.14": {"a::sweep": 541, "a::value_shaped": 693}, "2.15": {"a::sweep": 560, "a::value_shaped": 700}}


def test_a_recorded_torch_needs_the_exact_counts():
    assert check.problems({"a::sweep": 541, "a::value_shaped": 693}, RECORDED, "2.14") == []
    assert check.problems({"a::sweep": 540, "a::value_shaped": 693}, RECORDED, "2.14") == [
        "a::sweep: collected 540 cases, 541 recorded for torch 2.14"]
    assert check.problems({"a::value_shaped": 693}, RECORDED, "2.14") == [
        "a::sweep: collected 0 cases, 541 recorded for torch 2.14"]


def test_another_torch_needs_most_of_the_least_recorded():
    assert check.problems({"a::sweep": 500, "a::value_shaped": 650}, RECORDED, "2.16") == []
    (msg,) = check.problems({"a::sweep": 0, "a::value_shaped": 650}, RECORDED, "2.16")
    assert msg.startswith("a::sweep: collected 0 cases, fewer than 90% of the 541 recorded")


def test_the_committed_counts_name_the_sweeps():
    import json

    counts = json.loads(check.COUNTS.read_text())
    assert counts and all(n > 0 and t.startswith("tests/clone/test_opinfo_sweep.py::")
                          for per_torch in counts.values() for t, n in per_torch.items())
