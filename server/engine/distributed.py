"""One model split across processes (``mx.distributed``): rank 0 plans, every rank computes.

``kvserve serve --distributed``, started by ``mlx.launch``, runs the same command in every
process. Each loads the model and keeps its shard (``kvserve.server.models.shard``: tensor
parallel, or a pipeline of whole layers). Rank 0
runs HTTP, the scheduler and the engine loop; its runner is a ``LeaderRunner``, which sends
each ``StepPlan`` (``wire.py``) to the other ranks before running it. They ``follow``: run
the same plan on their own runner, so every rank merges, extends and filters the same batch
and its KV cache holds its own heads in the configured scheme.

    rank 0   [release b][execute plan n] -> runner.execute(plan n) -> tokens -> HTTP
    rank 1   <- the same message          -> runner.execute(plan n) (its shard)
             every forward ends with both ranks holding the same hidden state and logits

Sampling runs on every rank with the same keys over the same logits (an all-reduce leaves
every rank the same bits), so no token travels; each rank reports a digest of its tokens
with the next message and rank 0 stops at the first disagreement rather than serve it.

Messages travel by ``all_gather`` of fixed frames: rank 0's frame holds the message, the
others' their status (KV bytes, the digest). One collective per step; a message longer
than a frame sends its tail by an ``all_sum``. While idle, rank 0 sends a heartbeat every
``HEARTBEAT_S``, so a process that died is noticed without a request.

A collective with a dead peer raises (the ring backend: "connection to a peer was lost");
rank 0 then fails every request and refuses new ones (``EngineDown``: /health answers
503) and exits; the other ranks exit with a line naming the rank they lost. The ring
backend does not always raise: a failure inside a step queued ahead leaves its socket
threads stopped, and the next collective waits forever. ``PeerWatch`` therefore watches
the ring's own connections from a thread of its own and acts when one is closed.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
import zlib
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

from kvserve.server.engine.loop import EngineDown
from kvserve.server.engine.scheduler import StepPlan, StepResult
from kvserve.server.engine.wire import Mirror, plan_message

log = logging.getLogger("kvserve.distributed")

FRAME = 4096  # bytes each rank contributes to a message's all_gather
HEARTBEAT_S = 1.0


class GroupLost(EngineDown):
    """A process of the group is gone, or disagrees: the split model cannot go on."""


class Channel:
    """Rank 0's messages to every rank, the other ranks' statuses back, in one collective.

    Every rank calls ``exchange`` the same number of times, in the same order as the model's
    own collectives (one stream orders them all)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.closed = False  # rank 0 said close: peers that leave now are done, not lost

    def exchange(self, payload: dict | list) -> list[Any]:
        """Rank 0 passes the message, the others their status; returns every rank's payload."""
        data = json.dumps(payload, separators=(",", ":")).encode()
        if self.rank != 0 and len(data) > FRAME - 4:
            raise ValueError(f"a status of {len(data)} bytes does not fit a frame")
        frame = struct.pack("<I", len(data)) + data[: FRAME - 4]
        frame += bytes(FRAME - len(frame))
        try:
            gathered = mx.distributed.all_gather(_bytes_array(frame), group=self.group)
            raw = np.array(gathered).tobytes()
            out = []
            for r in range(self.size):
                (n,) = struct.unpack_from("<I", raw, r * FRAME)
                body = raw[r * FRAME + 4 : r * FRAME + 4 + min(n, FRAME - 4)]
                if n > FRAME - 4:  # only rank 0's message is ever longer
                    body += self._tail(data[FRAME - 4 :], n - (FRAME - 4))
                out.append(json.loads(body))
            return out
        except (RuntimeError, ValueError) as exc:
            # A peer killed inside the collective can leave its frame half written without
            # the backend raising: a frame that does not decode is a lost peer too.
            raise self.lost(exc) from None

    def _tail(self, data: bytes, n: int) -> bytes:
        mine = data if self.rank == 0 else bytes(n)
        return np.array(mx.distributed.all_sum(_bytes_array(mine), group=self.group)).tobytes()

    def lost(self, exc: BaseException) -> GroupLost:
        return group_lost(self.group, exc)


def neighbours(rank: int, size: int) -> str:
    """The ranks a ring's member talks to, for messages.

    >>> neighbours(0, 2), neighbours(1, 4)
    ('rank 1', 'rank 0 or rank 2')
    """
    return " or ".join(f"rank {r}" for r in sorted({(rank - 1) % size, (rank + 1) % size} - {rank}))


def group_lost(group, exc: BaseException) -> GroupLost:
    """The error that ends this process's part: which ranks it was talking to, and why."""
    rank, size = group.rank(), group.size()
    return GroupLost(f"rank {rank} of {size}: lost {neighbours(rank, size)}: {type(exc).__name__}: {exc}")


def _bytes_array(data: bytes) -> mx.array:
    return mx.array(np.frombuffer(data, dtype=np.uint8))


def tokens_digest(result: StepResult) -> int:
    """What a step sampled, in a number every rank computes the same way (any row order).

    >>> d = tokens_digest(StepResult(sampled={"a": 5, "b": 1}, accepted={"a": (3,)}))
    >>> d == tokens_digest(StepResult(sampled={"b": 1, "a": 5}, accepted={"a": (3,)}))
    True
    >>> d == tokens_digest(StepResult(sampled={"a": 5, "b": 1}))   # a kept proposal differs
    False
    """
    body = json.dumps([sorted(result.sampled.items()), sorted((k, list(v)) for k, v in result.accepted.items())])
    return zlib.crc32(body.encode())


class LeaderRunner:
    """Rank 0's runner: every call that changes the runner's state goes to the other ranks
    first (``release`` with the next message); reads are this rank's (``__getattr__``)."""

    heartbeat_s = HEARTBEAT_S  # the engine loop wakes this often while idle (``idle``)

    def __init__(self, runner, channel: Channel):
        self.runner, self.channel = runner, channel
        self._pending: list[list] = []  # releases since the last message
        self._sent: set[str] = set()  # requests the other ranks know
        self._steps = 0
        self._digests: dict[int, int] = {}  # this rank's digest of each step not yet confirmed
        self._kv = 0  # this rank's KV bytes after the last message, as the others report theirs
        self.kv_bytes_by_rank: dict[int, int] = {}

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, plan: StepPlan) -> StepResult:
        _seed(plan)
        self._send(["execute", plan_message(plan, self._sent)])
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # the other ranks ran this step too: no way back to agreement
            if isinstance(exc, RuntimeError):  # MLX raises these when a collective fails
                raise self.channel.lost(exc) from None
            raise GroupLost(f"rank 0 failed a step of the split model: {type(exc).__name__}: {exc}") from exc
        self._steps += 1
        self._digests[self._steps] = tokens_digest(result)
        self._kv = self.runner.kv_bytes
        return result

    def warm_stored_chunks(self, tokens: list[int]) -> int:
        """None here: a forward outside a step would run the split model's collectives on
        this rank alone (the other ranks wait for messages, not forwards)."""
        return 0

    def release(self, request_id: str, keep: bool = False) -> None:
        if request_id in self._sent:  # the others never saw a request no plan named
            self._pending.append(["release", request_id, keep])
            self._sent.discard(request_id)
        self.runner.release(request_id, keep)

    def idle(self) -> None:
        """Heartbeat (with any releases): a process that died shows now, not at the next request."""
        self._send(["ping"])
        self._kv = self.runner.kv_bytes
        self.runner.idle()

    def close(self) -> None:
        self.channel.closed = True
        try:
            self._send(["close"])
        except GroupLost as exc:
            log.warning("%s", exc)
        self.runner.close()

    def _send(self, op: list) -> None:
        ops, self._pending = [*self._pending, op], []
        statuses = self.channel.exchange(ops)[1:]
        self.kv_bytes_by_rank = {0: self._kv}
        for rank, status in enumerate(statuses, start=1):
            self.kv_bytes_by_rank[rank] = status["kv"]
            step, digest = status["step"], status["digest"]
            if step and digest != self._digests.get(step, digest):
                raise GroupLost(f"rank {rank} sampled other tokens than rank 0 at step {step}: the "
                                f"processes no longer compute the same model")
        confirmed = min((s["step"] for s in statuses), default=self._steps)
        self._digests = {k: v for k, v in self._digests.items() if k > confirmed}


def _seed(plan: StepPlan) -> None:
    """Requests without a seed get one here, so every rank draws the same tokens for them."""
    for r in (*(c.request for c in plan.prefill), *plan.decode):
        for m in (r, *r.forks):
            if m.params.seed is None:
                m.params = replace(m.params, seed=secrets.randbits(63))


def follow(runner, channel: Channel, wait=lambda: None) -> int:
    """Ranks other than 0: run every message rank 0 sends until it says close (returns 0)
    or the group breaks (returns 1, after a line naming the rank lost). ``wait`` returns
    when the next message is on its way (``RingSockets.wait``)."""
    mirror, status = Mirror(), {"kv": 0, "step": 0, "digest": 0}
    try:
        while True:
            wait()
            ops = channel.exchange(status)[0]
            for op in ops:
                if op[0] == "release":
                    runner.release(op[1], keep=op[2])
                    mirror.forget(op[1])
                elif op[0] == "execute":
                    result = runner.execute(mirror.plan(op[1]))
                    status = {"kv": 0, "step": status["step"] + 1, "digest": tokens_digest(result)}
                elif op[0] == "ping":
                    runner.idle()
                elif op[0] == "close":
                    channel.closed = True
                    return 0
            status["kv"] = runner.kv_bytes
    except GroupLost as exc:
        log.error("%s; exiting", exc)
        return 1
    except RuntimeError as exc:
        log.error("%s; exiting", channel.lost(exc))
        return 1
    finally:
        runner.close()


class AgreedPrefix:
    """A prefix cache whose hits every rank agrees on: each rank looks its own part up, and
    a hit is used only when every rank found the same number of tokens (a part lost on one
    rank is a miss on all). ``lookup`` is a collective: every rank calls it in plan order."""

    def __init__(self, prefix, group):
        self.prefix, self.group = prefix, group

    def __getattr__(self, name: str):
        return getattr(self.prefix, name)

    def lookup(self, tokens):
        hit = self.prefix.lookup(tokens)
        mine = mx.array([hit.num_tokens if hit is not None else 0], dtype=mx.int32)
        try:
            found = mx.distributed.all_gather(mine, group=self.group).tolist()
        except RuntimeError as exc:
            raise group_lost(self.group, exc) from None
        if hit is not None and len(set(found)) != 1:
            log.warning("prefix hit of %d tokens not used: the ranks found %s", hit.num_tokens, found)
            return None
        return hit

    def parting(self, tokens) -> int:
        """The shortest of every rank's ``parting``: each rank's prefill stops there, so
        their forwards (and the collectives inside them) stay in step."""
        mine = mx.array([self.prefix.parting(tokens)], dtype=mx.int32)
        try:
            return min(mx.distributed.all_gather(mine, group=self.group).tolist())
        except RuntimeError as exc:
            raise group_lost(self.group, exc) from None


class RingSockets:
    """This process's TCP connections to the other ranks of the ring backend, as duplicates
    of its file descriptors found by their addresses (``ring``: each rank's ``"ip:port"``,
    as in ``MLX_HOSTFILE``), each with the rank at the other end. They are peeked at or
    waited on, never read: the backend's own threads read them."""

    def __init__(self, rank: int, ring: list[list[str]]):
        self.rank, self.size = rank, len(ring)
        self._owner = {address: r for r, addresses in enumerate(ring) for address in addresses}
        self.sockets = self._find()
        self._poll = select.poll()  # not select(): no limit on the descriptors' numbers
        for sock, _ in self.sockets:
            self._poll.register(sock, select.POLLIN)

    def wait(self) -> None:
        """Return once a peer has sent something (or closed its end). The ring backend
        waits for a peer by polling its non-blocking sockets without sleeping, so a rank
        that enters a collective long before the others keeps a core busy the whole time:
        an idle follower waiting for rank 0's next message in ``all_gather`` held one core
        at 100% (5.0 s of CPU in 5 s, 2-core VM). Waiting here first, in the kernel, costs
        none; rank 0 sends first in every message, so the others wake in turn."""
        if self.sockets:
            self._poll.poll()  # readable, closed (POLLHUP) or failed (POLLERR) all wake it

    def _find(self) -> list[tuple[socket.socket, str]]:
        found = []
        for name in os.listdir("/dev/fd"):
            try:
                fd = os.dup(int(name))
            except (OSError, ValueError):
                continue
            try:
                sock = socket.socket(fileno=fd)
            except OSError:  # not a socket
                os.close(fd)
                continue
            try:
                ends = [f"{a[0]}:{a[1]}" for a in (sock.getsockname(), sock.getpeername())]
            except OSError:
                sock.close()
                continue
            if not any(end in self._owner for end in ends) or sock.type != socket.SOCK_STREAM:
                sock.close()
                continue
            found.append((sock, self._peer(ends[1])))
        return found

    def _peer(self, address: str) -> str:
        if address in self._owner:
            return f"rank {self._owner[address]}"
        return neighbours(self.rank, self.size)


class PeerWatch(threading.Thread):
    """Calls ``lost(reason)`` once, when a connection to a peer of the ring closes (the peer
    process exited or was killed), even while the engine thread waits on that peer for good.

    Each of the ring's sockets (``RingSockets``) is peeked at: an end of stream means the
    peer is gone. A peer whose machine vanishes without closing its connections is not
    seen here (the engine's stuck-step check reports it)."""

    def __init__(self, channel: Channel, ring: RingSockets, lost, interval: float = 0.5):
        super().__init__(name="kvserve-peer-watch", daemon=True)
        self.channel, self.lost, self.interval = channel, lost, interval
        self.rank, self.size = ring.rank, ring.size
        self._sockets = ring.sockets

    def run(self) -> None:
        while not self.channel.closed:  # after close, peers leave as they finish
            for sock, peer in self._sockets:
                try:
                    if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                        return self._lost(self._reason(peer, "closed its connection"))
                except BlockingIOError:
                    pass
                except OSError as exc:
                    return self._lost(self._reason(peer, f"connection failed ({exc})"))
            time.sleep(self.interval)

    def _lost(self, reason: str) -> None:
        if not self.channel.closed:
            self.lost(reason)

    def _reason(self, peer: str, what: str) -> str:
        return f"rank {self.rank} of {self.size}: lost {peer}: it {what}"
