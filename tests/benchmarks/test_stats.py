"""The paired statistics and the target judgment both reports share: the bootstrap interval of a
median, and when a quick run may decide a target."""

from benchmarks import stats, targets


def test_median_ci_brackets_the_median_and_is_reproducible():
    values = [0.9, 1.0, 1.01, 1.02, 1.1, 1.3]
    stat = stats.median_ci(values)
    assert stat[1] <= stat[0] <= stat[2]
    assert stat == stats.median_ci(values)


def test_judge_needs_enough_values_and_respects_each_bound():
    at_least = targets.Target("speedup", "", "", lower=4.0)
    assert at_least.judge(5.0, 4.5, 6.0, n=8, quick=True) == "PASS"
    assert at_least.judge(3.0, 2.5, 3.5, n=8, quick=True) == "FAIL"
    assert at_least.judge(4.2, 3.5, 5.0, n=8, quick=True) == "N/D"
    assert at_least.judge(5.0, 5.0, 5.0, n=1, quick=True) == "N/D"  # one ratio: no interval to speak of
    assert at_least.judge(3.9, 3.5, 5.0, n=1, quick=False) == "FAIL"  # a full run decides on the median
    band = targets.Target("within 1.6x", "", "", lower=1 / 1.6, upper=1.6)
    assert band.judge(1.0, 0.5, 2.0, n=8, quick=True) == "N/D"  # straddles both bounds
    assert band.judge(2.0, 1.7, 2.5, n=8, quick=True) == "FAIL"


def test_ratios_pair_by_round_and_a_round_of_several_steps_is_their_median():
    a = stats.by_round([0, 0, 1, None], [1.0, 3.0, 4.0, 9.0])  # None: a step outside the rounds
    assert a == {0: 2.0, 1: 4.0}
    assert stats.ratios(a, {1: 2.0, 2: 5.0}) == [2.0]


def test_two_rows_pair_in_the_rounds_they_share():
    from benchmarks.records import Row

    a = Row(config="a", step_times_s=[1.0, 3.0, 4.0], step_rounds=[0, 0, 1])
    b = Row(config="b", step_times_s=[1.0, 2.0], step_rounds=[1, 2])
    assert stats.per_round(a) == {0: 2.0, 1: 4.0}
    assert stats.paired(a, b) == [4.0]
