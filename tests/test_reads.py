"""The loop's reads of per-step scalars (core/reads.py): a wait for queued steps polls, and
backs off while the device computes, so that a large model's long steps (the char GPT's
~220 ms on a CPU) do not have the host waking thousands of times a second on the cores the
computation needs."""

from __future__ import annotations

import time

from jaxnitro import reads


class Late:
    """A pending step's scalars, computed ``seconds`` from now."""

    def __init__(self, seconds: float):
        self.at = time.perf_counter() + seconds

    def is_ready(self) -> bool:
        return time.perf_counter() >= self.at


def test_a_long_wait_polls_rarely_and_a_short_one_finely(monkeypatch):
    got = reads.StepReads.__new__(reads.StepReads)  # only the wait is exercised: processing is stubbed
    processed = []

    def process(n):
        processed.append(n)
        del got.pending[:n]
        return False

    got._process = process
    sleeps, sleep = [], time.sleep
    monkeypatch.setattr(reads.time, "sleep", lambda s: (sleeps.append(s), sleep(s)))
    got.pending = [Late(0.3), Late(0.3)]
    assert got.read(wait=True) is False and processed == [2]
    assert sleeps[0] == 0.0002 and max(sleeps) == 0.005  # from 0.2 ms up to 5 ms, a tenth of the wait so far
    assert len(sleeps) < 200  # 0.2 ms sleeps throughout would be ~1,500 wake-ups
    sleeps.clear()
    got.pending = [Late(0.002)]  # a short wait (a small model's last few steps) stays fine-grained
    got.read(wait=True)
    assert max(sleeps) <= 0.0005
