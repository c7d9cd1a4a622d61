"""Nothing accepted by the prefix cache's disk writer is lost at a stop; refusals are counted.

Inserts outrun the writer here for sure: the real ``Writer`` writes real files with
``write_entry``, but behind a gate the test holds closed while it inserts. Then the gate
opens and the cache is closed, as ``Engine.stop()`` does on SIGTERM (``ModelRunner.close``).
"""

from __future__ import annotations

import threading

from prefix_helpers import filled, state_bytes
from servers import random_llama
from stepping import drive

from kvserve.cache import parse_scheme
from kvserve.cache.prefix import Namespace, PrefixCache, files, writer
from kvserve.cache.prefix.files import Header
from kvserve.cache.prefix.snapshot import restore, take_snapshot
from kvserve.server.engine.request import Request, SamplingParams
from kvserve.server.engine.runner import ModelRunner

NS = Namespace("model-fp", "tok-hash", "fp16")
ENTRY_TOKENS = 24


class GatedWriter:
    """Records every job handed to the writer, in order; writes wait while the gate is shut."""

    def __init__(self, monkeypatch):
        self.gate = threading.Event()
        self.jobs: list = []
        real_write, real_submit = files.write_entry, writer.Writer.submit

        def write(path, metadata, tensors):
            self.gate.wait()
            return real_write(path, metadata, tensors)

        def submit(w, job):
            self.jobs.append(job)
            real_submit(w, job)

        monkeypatch.setattr(files, "write_entry", write)  # the Writer picks it up when created
        monkeypatch.setattr(writer.Writer, "submit", submit)

    def expected_files(self) -> dict[str, writer.WriteJob]:
        """What the queue leaves on disk, replayed in order: a write makes its file unless
        it was cancelled (its entry was replaced; a delete of that file always follows),
        a delete removes it."""
        present: dict[str, writer.WriteJob] = {}
        for job in self.jobs:
            if isinstance(job, writer.WriteJob) and not job.cancelled:
                present[job.path.name] = job
            elif isinstance(job, writer.DeleteJob):
                present.pop(job.path.name, None)
        return present


def entry(i: int) -> tuple[list[int], object]:
    """Distinct first tokens: no entry is a prefix of another, so none replaces another."""
    return [10_000 + i] + list(range(ENTRY_TOKENS - 1)), filled("fp16", ENTRY_TOKENS, seed=i)


def job_tokens(job: writer.WriteJob) -> list[int]:
    return list(Header(job.metadata, {}, 0, 0).tokens())


def assert_on_disk_and_loads_back(root, ns: Namespace, expected: dict[str, writer.WriteJob]) -> None:
    """Exactly the expected files exist, and a restarted cache loads each one back
    bit-identical to the snapshot that was queued."""
    assert sorted(p.name for p in root.iterdir()) == sorted(expected)
    pc = PrefixCache(ns, ram_bytes=1 << 26, disk_dir=root, disk_bytes=1 << 30)
    assert pc.stats()["disk_entries"] == len(expected) and not any(pc.stats()["refused"].values())
    for job in expected.values():
        hit = pc.lookup([*job_tokens(job), 1])
        assert (hit.source, hit.num_tokens) == ("disk", job.payload.num_tokens)
        assert state_bytes(hit.cache) == state_bytes(restore(job.payload, hit.num_tokens))
    pc.close()


def test_every_accepted_write_is_on_disk_after_a_stop_and_refusals_are_counted(tmp_path, monkeypatch):
    gated = GatedWriter(monkeypatch)
    size = take_snapshot(entry(0)[1]).nbytes  # every entry has this size
    # RAM holds 2 entries, the queue 3 writes: from the 4th insert on, the store refuses.
    pc = PrefixCache(NS, ram_bytes=2 * size, disk_dir=tmp_path, disk_bytes=1 << 30, max_pending_writes=3)
    for i in range(10):
        assert pc.insert(*entry(i))
    # The writer is stuck: entries 0-2 were queued (RAM evicting them keeps them, queued);
    # 3 and 4 were refused once (at insert), 5-9 twice (at insert, and the spill when RAM
    # evicted 3-7, which then left the index); 8 and 9 are in RAM.
    s = pc.stats()
    assert (s["pending_writes"], s["dropped_spills"], s["ram_entries"], s["entries"]) == (3, 12, 2, 5)
    assert [j.key for j in gated.jobs] == [NS.entry_key(entry(i)[0]) for i in range(3)]
    gated.gate.set()  # the writer drains at disk speed while the inserts go on
    for i in range(10, 60):
        assert pc.insert(*entry(i))
    gated.gate.clear()  # and stalls again: the stop finds writes queued
    for i in range(60, 70):
        assert pc.insert(*entry(i))
    assert pc.stats()["pending_writes"] >= 2  # at most one write passed the gate after it shut
    gated.gate.set()
    assert pc.close()  # what Engine.stop() does on SIGTERM: flush the queue, stop the thread
    s = pc.stats()
    assert (s["pending_writes"], s["write_errors"]) == (0, 0)
    accepted = {j.key for j in gated.jobs if isinstance(j, writer.WriteJob)}
    # Each of the 70 inserts was queued or refused; every refusal was counted.
    assert len(accepted) + s["dropped_spills"] >= 70 and len(accepted) < 70
    expected = gated.expected_files()
    assert len(expected) == len(accepted)  # nothing was replaced or evicted from disk
    assert_on_disk_and_loads_back(tmp_path, NS, expected)


def test_an_engine_stopped_under_load_leaves_every_queued_write_on_disk(tmp_path, monkeypatch):
    """Requests finish faster than the writer drains: a stop still writes everything queued
    (and still wanted: a finished request's prompt + reply replaces its prompt's entry)."""
    gated = GatedWriter(monkeypatch)
    ns = Namespace("tiny", "tok", "fp16")
    pc = PrefixCache(ns, ram_bytes=1 << 16, disk_dir=tmp_path, disk_bytes=1 << 30, max_pending_writes=8)
    runner = ModelRunner(random_llama(7), parse_scheme("fp16"), prefix=pc)
    prompts = [[1 + i] + [(7 * j) % 200 + 3 for j in range(30)] for i in range(12)]
    requests = [Request(p, SamplingParams(max_tokens=6, temperature=0.0), request_id=f"r{i}")
                for i, p in enumerate(prompts)]
    trace = drive(runner, requests, step_tokens=64, prefill=32, max_running=4)
    # 64 tokens a step: r0 and r1 prefill in the first step, r2 and r3 in the second, so
    # the queue took r0-r3's prompts (cancelled once their prompt + reply replaced them),
    # r0's and r1's prompt + reply, and r4's and r5's prompts; every later write, r2's and
    # r3's prompt + reply included, was refused and counted.
    s = pc.stats()
    assert s["pending_writes"] == 8 and s["dropped_spills"] > 0
    gated.gate.set()
    runner.close()  # Engine.stop() -> ModelRunner.close() -> PrefixCache.close()
    expected = gated.expected_files()
    # r2 and r3 decode on, so the step queued ahead fed r0's and r1's last tokens too.
    finished = [prompts[i] + trace.tokens[f"r{i}"] for i in range(2)]
    assert sorted(expected) == sorted(ns.entry_name(t) for t in finished)
    assert_on_disk_and_loads_back(tmp_path, ns, expected)
