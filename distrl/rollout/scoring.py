"""Where a generator's hand-backs are scored: at once (``--async_scoring 0``), or in threads while the engine
decodes on (``--async_scoring N``, at most N groups awaiting their rewards).

Scoring at once is the simple case: the engine waits while a hand-back's completions are scored, so a slow
reward (a remote verifier, a sandbox, a judge model) holds up every group behind it, and all of them arrive
with the same policy versions. Scoring in threads lets each group arrive when its own rewards are in: a slow
group arrives later, with an older policy version than the groups generated after it, and past
``--max_staleness`` the buffer drops it, as real asynchronous runs drop slow, long problems (the sampling
bias that ``learner/bias_*`` measures and ``--bias_correction reweight`` counters, docs/offpolicy.md).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
MAX_THREADS = 16  # threads of one generator that score at once (each runs one hand-back's scoring call)


class Scoring(Generic[T]):
    """Runs each hand-back's scoring job now (``limit`` 0) or in a thread (``limit`` N > 0).

    Args:
        limit: most groups whose jobs may be unfinished when :meth:`submit` returns (0: none, every job runs
            in the caller's thread); the scoring threads are ``min(limit, MAX_THREADS)``.
    """

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"--async_scoring must be >= 0, got {limit}")
        self.limit = limit
        self._pool = ThreadPoolExecutor(min(limit, MAX_THREADS), thread_name_prefix="scoring") if limit else None
        self._pending: list[tuple[Future, int]] = []  # (job, its groups), oldest first

    def waiting(self) -> int:
        """Groups whose scoring has not been collected yet."""
        return sum(groups for _, groups in self._pending)

    def submit(self, job: Callable[[], T], groups: int) -> list[T]:
        """Start ``job`` (the scoring of ``groups`` groups); return the results of the jobs ended by now, this
        one's first when it ran at once. Waits for jobs to end while more than ``limit`` groups await. A job's
        exception is raised here or by a later :meth:`collect`."""
        if self._pool is None:
            return [job()]
        self._pending.append((self._pool.submit(job), groups))
        return self.collect()

    def collect(self, drain: bool = False) -> list[T]:
        """The results of the jobs ended by now (``drain``: of all jobs, waiting for them), after waiting while
        more than ``limit`` groups await."""
        out: list[T] = []
        while self._pending:
            for item in [p for p in self._pending if p[0].done()]:
                self._pending.remove(item)
                out.append(item[0].result())
            if not self._pending or (not drain and self.waiting() <= self.limit):
                break
            wait([job for job, _ in self._pending], return_when=FIRST_COMPLETED)
        return out

    def close(self) -> None:
        """Drop the jobs not started and wait for the running ones (their groups are never PUT: not acknowledged,
        they are not part of the run)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pending.clear()
