"""Forks prefix-cache writers and SIGKILLs them, on request, from a small process.

``test_prefix_disk``'s kill test forks a writer a thousand times. Forked from the test
process, each fork copies the page tables of everything the suite has loaded by then (90-100
ms a fork, 96 s in all); forked from this process, which imports only the file writer, a
fork costs about a millisecond.

    python tests/kill_writers.py ROOT ENTRIES
      ENTRIES: a pickle of [(file name, [(metadata, tensors), ...]), ...]
      prints "ready"; then reads one delay in seconds per line, forks a writer that writes
      random entries under ROOT until killed, SIGKILLs it after the delay, and prints the
      indices of the entries it acknowledged (a write is acknowledged once complete)
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import sys
import time
from pathlib import Path

from kvserve.cache.prefix.files import write_entry


def write_until_killed(root: Path, entries: list, ack_fd: int) -> None:
    rng = random.Random(os.getpid())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        i = rng.randrange(len(entries))
        name, variants = entries[i]
        md, tensors = variants[rng.randrange(len(variants))]
        write_entry(root / name, md, tensors)
        os.write(ack_fd, f"{i}\n".encode())


def kill_round(root: Path, entries: list, delay: float) -> list[int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            write_until_killed(root, entries, w)
        finally:
            os._exit(0)
    os.close(w)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    acked = b""
    while chunk := os.read(r, 65536):
        acked += chunk
    os.close(r)
    return sorted({int(x) for x in acked.split()})


def main() -> None:
    root = Path(sys.argv[1])
    with open(sys.argv[2], "rb") as f:
        entries = pickle.load(f)
    print("ready", flush=True)
    for line in sys.stdin:
        print(" ".join(map(str, kill_round(root, entries, float(line)))), flush=True)


if __name__ == "__main__":
    main()
