"""Run client calls together from threads, all released at once by a barrier."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable


def together(calls: list[Callable[[], object]]) -> list[object]:
    """Results of ``calls`` in order; every call starts when all threads are ready."""
    barrier = threading.Barrier(len(calls))

    def run(call):
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))
