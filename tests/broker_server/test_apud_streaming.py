"""Streaming APUD aggregation holds running sums only: memory does not grow with the number of uploads."""

from __future__ import annotations

from bench.bench_apud import run


def test_memory_is_independent_of_the_number_of_uploads() -> None:
    # d = 100,000, K = 10,000 as in the issue; real encoded messages decoded and folded one by one.
    few = run(uploads=200, d=100_000, k=10_000, distinct=8, trace=True)
    many = run(uploads=2_000, d=100_000, k=10_000, distinct=8, trace=True)
    # Running sums num/den are 2 x 800 KB; 10x the uploads may not add even one upload's worth.
    assert many["peak_traced_bytes"] <= few["peak_traced_bytes"] + 100_000, (few, many)
    assert many["peak_traced_bytes"] < 8_000_000
