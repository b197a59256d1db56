"""The worker pool: order kept, a hung call stopped, a crashed worker replaced."""

from __future__ import annotations

import os
import time

from vlbatch.pipeline.workers import CallTimedOut, WorkerDied, WorkerPool
import workerfns
from workerfns import square_or_misbehave


def test_order_timeout_crash_and_error_each_stay_with_their_item():
    started = time.monotonic()
    with WorkerPool(workers=2, timeout_s=3, lookahead=4) as pool:
        results = list(pool.imap(square_or_misbehave, range(10), lambda x: (x,)))
    assert [item for item, _ in results] == list(range(10))
    by_item = dict(results)
    assert isinstance(by_item[3], CallTimedOut) and "timeout" in str(by_item[3])
    assert isinstance(by_item[5], WorkerDied) and "died" in str(by_item[5])
    assert isinstance(by_item[7], ValueError) and "seven" in str(by_item[7])
    assert [by_item[i] for i in (0, 1, 2, 4, 6, 8, 9)] == [0, 1, 4, 16, 36, 64, 81]
    assert time.monotonic() - started < 30  # the hung call did not hold the run for 60 s


def test_workers_run_below_the_engine_s_priority():
    from vlbatch.pipeline.workers import WORKER_NICENESS

    expected = min(os.nice(0) + WORKER_NICENESS, 19)
    with WorkerPool(2, timeout_s=30) as pool:
        results = [r for _, r in pool.imap(workerfns.niceness_or_crash, range(6), lambda x: (x,))]
    assert isinstance(results[0], WorkerDied)
    assert results[1:] == [expected] * 5
    assert os.nice(0) < expected  # the parent keeps its own priority
