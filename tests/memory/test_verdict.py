"""The memory verdict: a peak over the GPU or a plan more than 10 % off is an error naming the phase, the
holders and the fix; a peak that fits and agrees passes with one line."""
import pytest

from diffsynth_qie.fakegpu.verdict import GiB, MemoryVerdict, MemoryVerdictError, check_memory, gpu_bytes_of


def test_a_peak_over_the_gpu_names_phase_holders_and_fix():
    v = MemoryVerdict("steady-state step", peak_bytes=90 * GiB, gpu_bytes=80 * GiB, planned_bytes=89 * GiB,
                      holders=[("training/module.py:120 (forward)", 60 * GiB), ("memory/fp8.py:40 (q)", 20 * GiB)],
                      scaled="2 of 60 blocks run, scaled to 60")
    with pytest.raises(MemoryVerdictError) as caught:
        check_memory(v)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("steady-state step: fake-device peak 90.00 GiB (2 of 60 blocks")
    assert "exceeds the GPU's 80.00 GiB" in line and "training/module.py:120 (forward) 60.00 GiB" in line
    assert "qie plan --gpu_memory_gb 80" in line and "plan predicts" not in line  # 89 vs 90: within 10 %


@pytest.mark.parametrize("planned, fails", [(50.0, False), (54.9, False), (55.1, True), (44.9, True), (45.1, False)])
def test_the_plan_may_differ_by_ten_percent(planned, fails):
    v = MemoryVerdict("edit", peak_bytes=50 * GiB, gpu_bytes=80 * GiB, planned_bytes=int(planned * GiB))
    if fails:
        with pytest.raises(MemoryVerdictError, match=r"edit: .*qie plan predicts .*more than ±10% off.*planner"):
            check_memory(v)
    else:
        assert check_memory(v).startswith("edit: fake-device peak 50.00 GiB, fits the GPU's 80.00 GiB, plan")


def test_nothing_to_judge_passes_and_gpu_memory_flag_wins():
    assert check_memory(MemoryVerdict("edit", peak_bytes=GiB)) == "edit: fake-device peak 1.00 GiB"
    assert gpu_bytes_of(24) == 24 * GiB
    assert gpu_bytes_of(None) is None  # this machine has no GPU
