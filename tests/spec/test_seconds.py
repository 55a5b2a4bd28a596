"""The cost model's arithmetic (spec/seconds.py) against values computed by hand.

Rates and bytes are round numbers so each expected value below is a line of
arithmetic in its comment, done on paper, not by the code under test.
"""

from __future__ import annotations

import math

import pytest

from mergepipe.spec.plan import Plan
from mergepipe.spec.refinement import REFINE_WEIGHT, observe, refine
from mergepipe.spec.seconds import (
    BudgetWork,
    Prediction,
    Rates,
    Work,
    expert_bytes_within,
    minimum_seconds,
    predict,
)
from tests.spec.test_plan_json import make_plan

RATES = Rates(startup_seconds=1.6, exit_share=0.25, publish_seconds=0.5, sequential_read=100e6, random_read=50e6,
              write=200e6, flush=400e6, overlap=2.0, compute={"ties": (80e6, 40e6)})
WORK = Work("ties", base_bytes=1_000_000_000, expert_bytes=200_000_000, merged_bytes=300_000_000,
            output_bytes=1_000_000_000)


def test_every_phase_is_bytes_over_its_rate():
    seconds = predict(WORK, RATES)
    assert seconds == pytest.approx({
        "startup": 2.0,  # 1.6 to the first read, and a quarter of that to exit
        # the reads, 1e9 / 100e6 = 10 s and 0.2e9 / 50e6 = 4 s, less the 1.6 s read while torch loads
        # (no served start-up measured: all of the start-up), shared in proportion: x 12.4 / 14
        "base_read": 10.0 * 12.4 / 14,
        "expert_read": 4.0 * 12.4 / 14,
        "compute": 8.75,  # 0.3e9 / 80e6 + 0.2e9 / 40e6 = 3.75 + 5
        "write": 5.0,  # 1e9 / 200e6
        "publish": 3.0,  # 0.5 + 1e9 / 400e6
        "total": 18.075,  # 2 + max(12.4, 8.75, 5, 26.15 / 2) + 3
    })


def test_an_own_process_merge_reads_while_it_loads_torch():
    rates = Rates(1.6, 0.25, 0.5, 100e6, 50e6, 200e6, 400e6, 2.0, {"ties": (80e6, 40e6)},
                  served_startup_seconds=0.3)
    assert rates.loading_seconds == pytest.approx(1.3)  # what a served command does not spend
    assert rates.read_ahead_seconds == pytest.approx(1.3)  # 2 GiB would take 21.5 s at 100 MB/s: not capped
    fast = Rates(1.6, 0.25, 0.5, 4e9, 50e6, 200e6, 400e6, 2.0, {"ties": (80e6, 40e6)})
    assert fast.read_ahead_seconds == pytest.approx(2**31 / 4e9)  # 1.6 s of loading, but at most 2 GiB
    assert predict(WORK, fast)["base_read"] == pytest.approx(0.25 * (0.25 + 4 - 2**31 / 4e9) / 4.25)
    own, served = predict(WORK, rates), predict(WORK, rates, served=True)
    assert own["base_read"] + own["expert_read"] == pytest.approx(14 - 1.3)
    assert (served["base_read"], served["expert_read"]) == pytest.approx((10.0, 4.0))  # nothing to overlap
    # reads shorter than the loading cost the stream nothing: 1e8 / 100e6 + 1e7 / 50e6 = 1.2 s < 1.6 s
    small = predict(Work("ties", 100_000_000, 10_000_000, 0, 0), RATES)
    assert (small["base_read"], small["expert_read"]) == (0.0, 0.0)


def test_a_time_budget_spends_the_loading_on_reads_first():
    # base 50e6: 0.5 s of reading, so 1.1 s of the 1.6 s loading reads (1.6 - 0.5) * 50e6 = 55e6 expert bytes
    work = BudgetWork("ties", 50_000_000, 50_000_000, 0, 500_000_000, 1.0)
    # left = 3.625 - 2 - 0.5 - 50e6/400e6 = 1 s; write 0.25 s. Reads all inside the loading, so compute
    # decides: 1 / (1/40e6 + 1/80e6) = 26.67e6 (together: (1 - 0.25/2) / (0.0375e-6/2) = 46.7e6)
    assert expert_bytes_within(3.625, work, RATES) == pytest.approx(1 / 0.0375e-6)
    # left = 10 s: compute 10 / 0.0375e-6 = 266.7e6, past the 55e6 covered; reads (10 - 0.5 + 1.6) * 50e6
    # = 555e6 and together (10 + (0.5 - 1.6 + 0.25)/2 ... ) / 0.02875e-6 = 362.6e6 allow more
    assert expert_bytes_within(12.625, work, RATES) == pytest.approx(10 / 0.0375e-6)
    for seconds in (3.625, 12.625):  # and each is predicted at exactly its time
        e = expert_bytes_within(seconds, work, RATES)
        assert predict(Work("ties", 50_000_000, round(e), round(e), 50_000_000), RATES)["total"] == \
            pytest.approx(seconds, rel=1e-6)


@pytest.mark.parametrize("overlap, total", [  # the reads: 14 s, less the 1.6 s read while torch loads
    (1.0, 31.15),  # one after another: 2 + (12.4 + 8.75 + 5) + 3
    (2.0, 18.075),  # the shared sum (13.075) outlasts the reads (12.4)
    (3.0, 17.4),  # side by side: the longest part, the reads
])
def test_the_stream_is_its_longest_part_or_its_sum_over_the_overlap(overlap, total):
    rates = Rates(1.6, 0.25, 0.5, 100e6, 50e6, 200e6, 400e6, overlap, {"ties": (80e6, 40e6)})
    assert predict(WORK, rates)["total"] == pytest.approx(total)


def test_compute_adds_what_the_bytes_moved_beside_it_take():
    rates = Rates(1.6, 0.25, 0.5, 100e6, 50e6, 200e6, 400e6, 2.0, {"ties": (80e6, 40e6)}, steal=1e-9)
    seconds = predict(WORK, rates)
    assert seconds["compute"] == pytest.approx(8.75 + 2.2)  # + 1 s per GB of the 1e9 + 0.2e9 + 1e9 moved
    assert seconds["total"] == pytest.approx(2 + 14.175 + 3)  # the shared sum (12.4 + 10.95 + 5) / 2 outlasts 12.4


def test_a_merge_faster_than_its_operator_alone_measures_no_steal_and_a_faster_operator():
    realized = {"read_wait": 0.5, "compute": 5.0, "write": 6.0, "write_wait": 1.5, "total": 18.0}
    observed = observe(WORK, RATES, realized)
    assert observed["steal"] == 0.0  # 5 s is under the operator's own 8.75 s (0.3e9 / 80e6 + 0.2e9 / 40e6)
    # its calibration was slowed: both rates 8.75 / 5 = 1.75 times faster, so this merge's compute is 5 s
    assert observed["compute_merged:ties"] == pytest.approx(140e6)
    assert observed["compute_expert:ties"] == pytest.approx(70e6)
    refined, moved = refine(RATES, observed)
    assert refined.compute["ties"] == pytest.approx((100e6, 50e6))  # a third of the way (REFINE_WEIGHT)
    assert {"compute_merged:ties", "compute_expert:ties"} <= set(moved)


def test_a_merge_slower_than_its_operator_alone_leaves_the_operator_as_calibrated():
    realized = {"read_wait": 0.5, "compute": 12.0, "write": 6.0, "write_wait": 1.5, "total": 18.0}
    observed = observe(WORK, RATES, realized)
    assert not any(name.startswith("compute_") for name in observed)
    assert observed["steal"] == pytest.approx((12.0 - 8.75) / 2.2e9)  # per byte moved: 1e9 + 0.2e9 + 1e9


def test_steal_is_learned_from_zero_up_to_ten_times_its_scale():
    refined, moved = refine(RATES, {"steal": 0.3e-9})
    assert refined.steal == pytest.approx(0.1e-9) and moved == ["steal"]  # a third of the way from 0
    refined, moved = refine(RATES, {"steal": 5e-9})  # 5 s per GB from nothing: a tiny merge's fixed costs
    assert refined.steal == 0.0 and moved == []


def test_a_served_command_starts_at_its_own_measured_start_up_without_an_exit():
    rates = Rates(1.6, 0.25, 0.5, 100e6, 50e6, 200e6, 400e6, 2.0, {"ties": (80e6, 40e6)},
                  served_startup_seconds=0.3)
    served = predict(WORK, rates, served=True)
    assert served["startup"] == pytest.approx(0.3)  # not 1.6 * 1.25
    assert served["total"] == pytest.approx(19.0 - 2.0 + 0.3)
    assert predict(WORK, rates)["startup"] == pytest.approx(2.0)  # a fresh process: as before
    # never measured (a catalog calibrated before served start-ups): predicted as a fresh process
    assert predict(WORK, RATES, served=True)["startup"] == pytest.approx(2.0)
    # a time budget gives a served merge the 1.7 s it does not spend starting: 1.7 s more of expert reads
    work = BudgetWork("ties", 1_000_000_000, 1_000_000_000, 0, 500_000_000, 1.0)
    assert expert_bytes_within(15.1, work, rates, served=True) == pytest.approx((0.1 + 1.7) * 50e6)
    assert minimum_seconds(work, rates, served=True) == pytest.approx(15.0 - 1.7)


def test_the_served_start_up_is_stored_only_where_measured_and_learned_under_its_own_name():
    rates = Rates(1.6, 0.25, 0.5, 100e6, 50e6, 200e6, 400e6, 2.0, {"ties": (80e6, 40e6)},
                  served_startup_seconds=0.3)
    assert rates.to_values()["served_startup_seconds"] == 0.3
    assert Rates.from_values(rates.to_values()) == rates
    assert "served_startup_seconds" not in RATES.to_values()
    assert Rates.from_values(RATES.to_values()).served_startup_seconds is None
    realized = {"startup": 0.4, "compute": 5.0, "total": 18.0}
    assert observe(WORK, rates, realized, served=True)["served_startup_seconds"] == 0.4
    assert "startup_seconds" not in observe(WORK, rates, realized, served=True)
    assert observe(WORK, rates, realized)["startup_seconds"] == 0.4
    refined, moved = refine(rates, {"served_startup_seconds": 0.5})
    assert refined.served_startup_seconds == pytest.approx(0.3 + 0.2 / 3) and moved == ["served_startup_seconds"]
    with pytest.raises(ValueError, match="served_startup_seconds"):
        Rates(1.6, 0.25, 0.5, 100e6, 50e6, 200e6, 400e6, 2.0, {}, served_startup_seconds=0.0)


def test_an_operator_never_calibrated_is_not_guessed():
    assert predict(Work("slerp", 1, 1, 1, 1), RATES) is None


def test_a_time_budget_becomes_the_expert_bytes_of_its_tightest_part():
    work = BudgetWork("ties", base_bytes=1_000_000_000, output_bytes=1_000_000_000, merged_fixed=0,
                      merged_variable=500_000_000, merged_per_expert_byte=1.0)
    # left = 25 - 1.6 * 1.25 - 0.5 - 1e9/400e6 = 20 s; the write (5 s) fits. The base's 10 s of reading
    # less the 1.6 s read while torch loads: 8.4 s.
    # reads:    (20 - 8.4) * 50e6 = 580e6
    # compute:  20 / (1/40e6 + 1/80e6) = 533.3e6, past the 500e6 merged cap: (20 - 6.25) * 40e6 = 550e6
    # together: (8.4 + 5)/2 + E * (1/50e6 + 1/40e6)/2 + E/80e6/2 <= 20  ->  E = 13.3 / 0.02875e-6
    assert expert_bytes_within(25.0, work, RATES) == pytest.approx(13.3 / 0.02875e-6)
    # and that many bytes (each merging as much base) is predicted to take exactly the 25 s
    e = 13.3 / 0.02875e-6
    assert predict(Work("ties", 1_000_000_000, round(e), round(e), 1_000_000_000), RATES)["total"] == \
        pytest.approx(25.0, rel=1e-6)


def test_a_time_budget_capped_by_the_reads_and_by_the_merged_bytes():
    rates = Rates(1.6, 0.25, 0.5, 100e6, 50e6, 200e6, 400e6, 3.0, {"ties": (80e6, 40e6)})
    work = BudgetWork("ties", 1_000_000_000, 1_000_000_000, 100_000_000, 200_000_000, 1.0)
    # left = 20 s. reads: (20 - (10 - 1.6)) * 50e6 = 580e6 (the base's first 1.6 s read while torch loads)
    # compute: fixed 1e8/80e6 = 1.25 s; 18.75 / (3/80e6) = 500e6 > the 200e6 cap, so
    #          (20 - 1.25 - 2e8/80e6) * 40e6 = 16.25 * 40e6 = 650e6
    # together (/3): fixed (10 + 1.25 + 5)/3; slope 0.045e-6/3 then, past the cap, 0.0125e-6 + ... :
    #          first piece: (60 - 16.25) / (0.045e-6 + 0.0125e-6) = 760.9e6 > cap; second piece:
    #          (60 - 16.25 - 2.5) / 0.045e-6 = 916.7e6 (less still with the loading: 8.4 s of base reads)
    assert expert_bytes_within(25.0, work, rates) == pytest.approx(580e6)


def test_a_time_budget_counts_what_moving_bytes_takes_from_compute():
    rates = Rates(1.6, 0.25, 0.5, 100e6, 50e6, 200e6, 400e6, 3.0, {"ties": (80e6, 40e6)}, steal=1e-9)
    work = BudgetWork("ties", 1_000_000_000, 1_000_000_000, 0, 500_000_000, 1.0)
    # left = 25 - 2 - 0.5 - 2.5 = 20 s. reads: (20 - (10 - 1.6)) * 50e6 = 580e6.
    # compute: fixed 1e-9 * (1e9 base + 1e9 output) = 2 s; per expert byte 1/40e6 + 1e-9 = 0.026e-6, and
    #          the base byte it merges 1/80e6 = 0.0125e-6: (20 - 2) / 0.0385e-6 = 467.5e6, under the cap
    # together (/3) allows more (fixed 17/3 s, then 735e6 > cap, so (20 - 17/3 - 2.5/3) / (0.046e-6/3) = 799e6)
    e = 18 / 0.0385e-6
    assert expert_bytes_within(25.0, work, rates) == pytest.approx(e)
    # and the plan reading that much is predicted at exactly 25 s, compute being its longest part
    seconds = predict(Work("ties", 1_000_000_000, round(e), round(e), 1_000_000_000), rates)
    assert seconds["total"] == pytest.approx(25.0, rel=1e-6)
    assert seconds["compute"] == pytest.approx(20.0, rel=1e-6)


def test_a_time_budget_shorter_than_reading_nothing_is_negative():
    work = BudgetWork("ties", 1_000_000_000, 1_000_000_000, 0, 500_000_000, 1.0)
    # reading nothing: 2 + max(10 - 1.6, 0, 5, 13.4/2) + 3 = 13.4 s (the base's first 1.6 s read while torch loads)
    assert minimum_seconds(work, RATES) == pytest.approx(13.4)
    assert expert_bytes_within(13.3, work, RATES) < 0
    assert expert_bytes_within(4.0, work, RATES) < 0  # not even the write fits
    assert expert_bytes_within(13.5, work, RATES) == pytest.approx(0.1 * 50e6)


def test_refinement_moves_a_rate_by_the_documented_weight():
    refined, moved = refine(RATES, {"write": 100e6, "compute_merged:ties": 100e6})
    assert REFINE_WEIGHT == pytest.approx(1 / 3)
    assert refined.write == pytest.approx(200e6 - 100e6 / 3)
    assert refined.compute["ties"] == pytest.approx((80e6 + 20e6 / 3, 40e6))  # the expert rate unchanged
    assert moved == ["compute_merged:ties", "write"]


def test_refinement_leaves_out_a_measurement_ten_times_off():
    refined, moved = refine(RATES, {"write": 19e6, "startup_seconds": 25.0, "flush": 3000e6})
    assert (refined.write, refined.startup_seconds) == (200e6, 1.6)
    assert refined.flush == pytest.approx(400e6 + 2600e6 / 3)
    assert moved == ["flush"]


def test_what_a_merge_measures():
    """A worker that writes itself (no write_wait): its time is read_wait + compute + write = 22 s."""
    realized = {"startup": 3.0, "read_wait": 0.5, "compute": 17.5, "write": 4.0, "hash": 1.0, "publish": 1.5,
                "total": 30.0}
    observed = observe(WORK, RATES, realized)
    assert observed == pytest.approx({
        "startup_seconds": 3.0,
        # the operator's own 8.75 s took 17.5: 8.75 s lost to the 1e9 + 0.2e9 + 1e9 bytes read and written
        "steal": 8.75 / 2.2e9,
        "write": 250e6,  # 1e9 / 4
        "publish_seconds": 0.5 * 8 / 3,  # the rest of the total, 30 - 22 = 8 s, for a predicted 3 s
        "flush": 400e6 * 3 / 8,
        "overlap": 33.9 / 22,  # the worker's 22 s for parts 12.4 (reads, after the loading) + 17.5 + 4
    })


def test_what_a_merge_with_a_write_behind_thread_measures():
    """The worker waits for the writer (write_wait) instead of writing: its time is 0.5 + 13 + 1.5 = 15 s."""
    realized = {"read_wait": 0.5, "compute": 13.0, "write": 6.0, "write_wait": 1.5, "publish": 0.5, "total": 18.0}
    observed = observe(WORK, RATES, realized)
    assert observed["write"] == pytest.approx(1e9 / 6)
    assert observed["publish_seconds"] == pytest.approx(0.5)  # the rest, 18 - 15 = 3 s, as predicted
    assert observed["overlap"] == pytest.approx(31.4 / 15)  # (12.4 + 13 + 6) / 15


def test_an_observed_overlap_is_at_least_one():
    realized = {"read_wait": 20.0, "compute": 1.0, "write": 1.0, "write_wait": 1.0, "total": 25.0}
    assert observe(WORK, RATES, realized)["overlap"] == 1.0  # (12.4 + 1 + 1) / 22 is below 1: one after another


def test_a_worker_no_longer_than_its_longest_part_says_nothing_of_the_overlap():
    realized = {"compute": 8.0, "write": 4.0, "read_wait": 0.4, "total": 17.0}  # worker 12.4 = the predicted reads
    assert "overlap" not in observe(WORK, RATES, realized)


def test_rates_and_predictions_round_trip():
    assert Rates.from_values(RATES.to_values()) == RATES
    assert Rates.from_values({k: v for k, v in RATES.to_values().items() if k != "flush"}) is None
    prediction = Prediction("host/2 cpus/cpu", WORK, predict(WORK, RATES))
    assert Prediction.from_json(prediction.to_json()) == prediction


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_a_rate_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="write"):
        Rates(1.6, 0.25, 0.5, 100e6, 50e6, bad, 400e6, 2.0)


def test_a_plans_predicted_seconds_are_kept_out_of_its_digest():
    plain = make_plan()
    prediction = Prediction("host/2 cpus/cpu", WORK, predict(WORK, RATES))
    predicted = make_plan(seconds=prediction)
    assert predicted.digest == plain.digest and predicted == plain
    assert "seconds" not in plain.to_json()  # an uncalibrated plan's JSON is as it was
    data = predicted.to_json()
    assert data["seconds"]["phases"]["total"] == pytest.approx(18.075)
    again = Plan.from_json(predicted.to_json_str())
    assert again.seconds == prediction and again.digest == plain.digest
