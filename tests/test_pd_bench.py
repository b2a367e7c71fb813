"""dflash-bench --pd's arithmetic (bench/pd.py): the window of inter-token gaps, percentiles,
and the token comparison of two runs; the run itself is in docs/BENCHMARKS.md."""

from __future__ import annotations

import pytest

from dflash_qaic.bench.pd import same_tokens, summary


def _run(stream_times, long_times, window, ids=(1, 2)):
    return {
        "streams": [[(t[0] - 0.01, list(t), list(ids))] for t in stream_times],
        "long": [(t[0] - 0.1, list(t), [7]) for t in long_times],
        "window": window,
    }


def test_summary_counts_the_gaps_ending_in_the_window():
    # one stream: gaps 0.01, 0.01, 0.20 (ends at 1.22, inside), 0.01 (ends at 1.23, inside)
    run = _run([(1.0, 1.01, 1.02, 1.22, 1.23)], [(1.2,)], (1.1, 1.25))
    s = summary(run)
    assert s["gaps_in_window"] == 2
    assert s["itl_window_ms"] == pytest.approx((200.0, 200.0))  # p50 of [10, 200]: index 1
    assert s["itl_all_ms"][1] == pytest.approx(200.0)
    assert s["ttft_ms"] == pytest.approx((10.0, 10.0)) and s["long_ttft_ms"][0] == pytest.approx(
        100.0
    )


def test_same_tokens_compares_what_both_runs_made():
    a = _run([(1.0, 1.1)], [(2.0,)], (0, 3))
    b = _run([(1.0, 1.1)], [(2.0,)], (0, 3))
    b["streams"][0].append((3.0, [3.1], [9]))  # one more round: not compared
    assert same_tokens(a, b)
    b["streams"][0][0] = (1.0, [1.1], [1, 3])
    assert not same_tokens(a, b)
    assert not same_tokens(a, {**a, "long": []})
