"""A pytest plugin: what killed a test worker, printed in the run's summary.

A pytest-xdist worker that takes a fatal signal (a segfault in native code) writes its
Python stacks to its stderr, which reaches the run's output as loose lines among the
progress dots, and the summary says only ``worker 'gw0' crashed while running '<test>'``.
Here each worker writes that dump (every thread's stack, the faulting one first) to a file
of its own, and the run's summary prints the files that are not empty, under the failure
that names the test:

    ==================== fatal errors in test workers ====================
    gw0: Fatal Python error: Segmentation fault
    gw0:
    gw0: Thread 0x00007f... (most recent call first):
    gw0:   File ".../test_x.py", line 3 in test_crash

A run without workers keeps pytest's own handler: its dump ends the output anyway.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
from pathlib import Path

import pytest

FOLDER_ENV = "KVSERVE_TEST_FAULTS"  # set by the controller, read by the workers it starts
# Frames of the test harness, below every test's own (the summary leaves them out).
HARNESS = ("/_pytest/", "/pluggy/", "/execnet/", "/xdist/", 'File "<string>"')
_SINK = pytest.StashKey()  # a worker's dump file
_OWNED = pytest.StashKey()  # the controller's folder of dumps


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler setting, which it replaces
def pytest_configure(config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        if not os.environ.get(FOLDER_ENV):  # workers start after this, with this environment
            os.environ[FOLDER_ENV] = tempfile.mkdtemp(prefix="kvserve-test-faults-")
            config.stash[_OWNED] = Path(os.environ[FOLDER_ENV])
        return
    folder = os.environ.get(FOLDER_ENV)
    if folder:
        sink = open(Path(folder) / f"{worker}.txt", "w")  # open until the worker dies
        config.stash[_SINK] = sink
        faulthandler.enable(file=sink, all_threads=True)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") or not os.environ.get(FOLDER_ENV):
        return
    dumps = sorted(p for p in Path(os.environ[FOLDER_ENV]).glob("*.txt") if p.stat().st_size)
    if dumps:
        terminalreporter.section("fatal errors in test workers", red=True)
        for path in dumps:
            for line in path.read_text(errors="replace").splitlines():
                if not any(part in line for part in HARNESS):
                    terminalreporter.line(f"{path.stem}: {line}")


def pytest_unconfigure(config) -> None:
    sink = config.stash.get(_SINK, None)
    if sink is not None:
        faulthandler.disable()
        sink.close()
    owned = config.stash.get(_OWNED, None)
    if owned is not None:
        shutil.rmtree(owned, ignore_errors=True)
        os.environ.pop(FOLDER_ENV, None)
