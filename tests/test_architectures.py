"""The real server on tiny random-weight models of many mlx-lm architectures (tests/archs.py):
full attention, 16-token sliding windows, attention sinks, KV-shared layers and recurrent
state, each in the schemes fp16, affine4 and turbo0v4.

Per (architecture, scheme) one server runs every check, restarted once:

- four token-level prompts of 41-80 tokens (longer than the window), greedy, sent one after
  the other and then all at once: in fp16 the concurrent replies equal the lone ones token
  for token (a row's K/V come from its own tokens only, other rows' slots are masked); in
  quantized schemes they may part only at a near-tie, the bound test_real_model.py sets
  (random weights leave top-2 gaps of 1e-4 nats now and then: exact agreement, which
  test_batching.py pins for its own model, flips there). The concurrent requests start from
  whatever the lone ones left in the prefix cache, so they are compared with a second lone
  round that did too (a quantized hit differs from a cold prefill by design); fp16 also
  equals the first, cold round. Every model finds each prompt but its last token cached (a
  window reaches back that far; a recurrent state comes from the checkpoint the prefix cache
  keeps at that length). The engine's step count shows the rows decoded together.
- the prefix cache across a restart: prompt A gets reply R; A + R + B starts from a cached
  prefix (A, or A plus R as far as it was fed), and again, sent a second time, from what is
  cached then; after a stop (the engine finishes and flushes the disk writer; a process
  drains first, on SIGTERM) a new server on the same ``--prompt-cache-dir`` starts it from
  that same prefix, read from disk, and continues with the second reply's tokens (in fp16,
  the first reply's too).

Every case's server is the configuration, engine and HTTP app of ``kvserve serve`` inside
the test process (``tests/inprocess.py``), restarted by stopping the engine (which finishes
its requests and flushes the disk writer, as SIGTERM does) and starting a new one on the same
directories: the new engine's prefix cache starts empty in RAM, so what it finds it reads
from the files. A process start costs about 3 s of CPU (most of it imports), as much as all
of a case's requests. The restart of a real process (SIGTERM, a new process reading the
files: no module state shared, no hash seed) is ``test_http.py``'s
``test_a_restarted_server_reuses_prompt_cache_files``; the files themselves hold no
process state (their keys are hashlib digests, ``cache/prefix``). Each case's server is
launched while the case before it runs (``Launcher``).
``test_mlx_lm_decodes_it`` is the control: mlx-lm alone, with its own caches, loads the
directory and decodes it. The start-up refusals: one as a process (its exit code and one
line), the others in this process (the error that line prints).

The server reports tokens as text (``logprobs.tokens``), not ids; reply ids are recovered by
inverting the tokenizer's one-token decodes, which is exact except for the few ids that
decode to a replacement character.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import httpx
import pytest

from archs import ARCHS, make_tiny_model, prompt_tokens
from inprocess import InProcessServer
from together import together

from kvserve.bench.soak import metrics

SCHEMES = ("fp16", "affine4", "turbo0v4")
PROMPTS = [prompt_tokens(100 + i, n) for i, n in enumerate((41, 55, 67, 80))]
MAX_TOKENS = 12
A, B = prompt_tokens(200, 48), prompt_tokens(201, 10)  # the prefix-cache conversation
TIMEOUT = 60  # s per request: every request here takes well under a second when it works


# --- fixtures: one model directory per architecture, one server per (architecture, scheme) ---

@pytest.fixture(scope="session", params=list(ARCHS))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=SCHEMES)
def scheme(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def models(tmp_path_factory, default_model_dir) -> Callable[[str], Path]:
    """The model directory of an architecture, built on first use."""
    root = tmp_path_factory.mktemp("archs")

    @lru_cache(maxsize=None)
    def model_dir(arch: str) -> Path:
        return make_tiny_model(arch, root / arch, default_model_dir)

    return model_dir


@pytest.fixture(scope="session")
def arch_dir(arch, models) -> Path:
    return models(arch)


@dataclass
class Served:
    """A server of one model and scheme in this process (``InProcessServer``), with the
    directories a restart keeps."""

    model_dir: Path
    scheme: str
    cache_dir: Path
    prompt_cache_dir: Path
    proc: InProcessServer | None = field(default=None, init=False)
    client: httpx.Client | None = field(default=None, init=False)  # one per start: a client
    # costs 40 ms of CPU to make (its SSL context), a third of a request to these models

    def launch(self) -> "Served":
        self.proc = InProcessServer(self.model_dir, "--kv-scheme", self.scheme, "--cache-dir",
                         str(self.cache_dir), "--prompt-cache-dir", str(self.prompt_cache_dir))
        self.client = httpx.Client(base_url=self.proc.base_url, timeout=TIMEOUT)
        return self

    def wait(self) -> "Served":
        self.proc.wait_ready(timeout=120)
        return self

    def start(self) -> "Served":
        return self.launch().wait()

    def stop(self) -> int:
        self.client.close()
        return self.proc.stop()

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        """A greedy /v1/completions of token ids, with each token's two best alternatives."""
        body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "logprobs": 2}
        response = self.client.post("/v1/completions", json=body)
        assert response.status_code == 200, (response.status_code, response.text[:500], self.log_tail())
        return response.json()

    def steps(self) -> float:
        """Engine steps so far (every decode step of the whole batch counts one)."""
        lines = self.client.get("/metrics").text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("kvserve_step_seconds_count"))

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.proc.output().splitlines()[-lines:])


class Launcher:
    """Launches each case's server while the case before it runs. A server in this process
    takes about 1.3 s of CPU to start (the tokenizer's load and hash); waited for one after
    another, starts were much of the time this file took."""

    def __init__(self, order: list[tuple[str, str]], models: Callable[[str], Path], root: Path):
        self.order, self.models, self.root = order, models, root
        self.pending: dict[tuple[str, str], Served] = {}

    def take(self, arch: str, scheme: str) -> Served:
        """This case's server, launched (not yet ready); the next case's is launched too."""
        case = (arch, scheme)
        server = self.pending.pop(case, None) or self._launch(case)
        later = self.order[self.order.index(case) + 1:] if case in self.order else []
        if later and later[0] not in self.pending:
            try:
                self.pending[later[0]] = self._launch(later[0])
            except Exception:  # e.g. its model fails to build: its own case reports that
                pass
        return server

    def _launch(self, case: tuple[str, str]) -> Served:
        arch, scheme = case
        d = self.root / f"{arch}-{scheme}"
        return Served(self.models(arch), scheme, d / "cache", d / "prompt-cache").launch()

    def close(self) -> None:
        for server in self.pending.values():  # launched for a case that did not run (-x, -k)
            server.stop()


@pytest.fixture(scope="session")
def launcher(request, models, tmp_path_factory):
    """Cases in the order pytest runs them (parametrized session and module fixtures are
    grouped: every scheme of one architecture, then the next architecture)."""
    order: list[tuple[str, str]] = []
    for item in request.session.items:  # the whole run: other modules have a `scheme` too
        params = getattr(item, "callspec", None) and item.callspec.params
        if not params or "scheme" not in params or item.module.__name__ != __name__:
            continue
        if (params["arch"], params["scheme"]) not in order:
            order.append((params["arch"], params["scheme"]))
    launcher = Launcher(order, models, tmp_path_factory.mktemp("servers"))
    yield launcher
    launcher.close()


@pytest.fixture(scope="module")
def served(arch, scheme, launcher):
    server = launcher.take(arch, scheme).wait()
    yield server
    server.stop()


# --- replies as tokens ---

def tokens_of(reply: dict) -> list[str]:
    return reply["choices"][0]["logprobs"]["tokens"]


def cached_tokens(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def divergence(lone: dict, other: dict) -> str:
    """Where two greedy replies part, for a failure message."""
    a, b = tokens_of(lone), tokens_of(other)
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return "no divergence" if i is None else f"token {i}: {a[i]!r} then {b[i]!r} ({a} / {b})"


# Quantized schemes, batched against alone: the bound test_real_model.py sets. A batched
# forward rounds differently from a lone one (other GEMM shapes), a value on a quantization
# boundary can then take the other code, and a near-tie can flip: where the replies part,
# the batched token must be the lone run's runner-up, less than NEAR_TIE nats below.
NEAR_TIE = 0.25


def divergence_gap(lone: dict, batched: dict) -> float | None:
    """At the first differing token: how far the batched pick sat below the lone pick in the
    lone run (None when the replies agree)."""
    a, b = lone["choices"][0]["logprobs"], batched["choices"][0]["logprobs"]
    for i, (mine, theirs) in enumerate(zip(a["tokens"], b["tokens"])):
        if mine != theirs:
            ranked = a["top_logprobs"][i]
            assert theirs in ranked, f"token {i}: batched {theirs!r} was not even the runner-up to {mine!r}"
            return a["token_logprobs"][i] - ranked[theirs]
    return None


@lru_cache(maxsize=None)
def token_ids_by_text(tokenizer_dir: Path) -> dict[str, int | None]:
    """Each one-token decode of the tokenizer mapped to its id (None where several ids decode
    to the same text, e.g. the partial UTF-8 sequences shown as U+FFFD)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids: dict[str, int | None] = {}
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        ids[text] = None if text in ids else i
    return ids


def known_ids(tokenizer_dir: Path, tokens: list[str]) -> list[int]:
    """The ids of ``tokens`` up to the first whose text several ids share."""
    table, out = token_ids_by_text(tokenizer_dir), []
    for text in tokens:
        if table.get(text) is None:
            break
        out.append(table[text])
    return out


# --- the control: mlx-lm alone ---

def test_mlx_lm_decodes_it(arch_dir):
    """mlx-lm loads the directory's model and decodes 20 greedy tokens with its own caches;
    two prompts continue differently, and neither repeats one token throughout. (Its
    tokenizer: ``make_tiny_model`` checked that the whole ``mlx_lm.load`` reads the directory,
    and every server here loads it again; this control needs the model only.)"""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(arch_dir)
    outs = []
    for prompt in PROMPTS[:2]:
        cache = make_prompt_cache(model)
        steps = generate_step(mx.array(prompt), model, max_tokens=20, prompt_cache=cache)
        outs.append([int(token) for token, _ in steps])
    assert all(len(out) == 20 and len(set(out)) > 1 for out in outs), outs
    assert outs[0] != outs[1]


# --- the server ---

def test_concurrent_requests_decode_as_each_alone(served):
    """Lone and concurrent requests that start from the same cached prefix decode the same
    tokens in fp16, and in quantized schemes part only at a near-tie (``NEAR_TIE``). A
    quantized hit differs from a cold prefill by design (the last prompt token attends over
    stored codes instead of fresh K/V), so only fp16 is held to the cold replies as well
    (as in test_prefix_engine.py)."""
    cold = [served.complete(p, MAX_TOKENS) for p in PROMPTS]
    warm = [served.complete(p, MAX_TOKENS) for p in PROMPTS]  # each from its cached prompt
    steps = served.steps()
    batched = together([lambda p=p: served.complete(p, MAX_TOKENS) for p in PROMPTS])
    batched_steps = served.steps() - steps
    assert [len(tokens_of(r)) for r in cold] == [MAX_TOKENS] * len(PROMPTS)
    assert len({tuple(tokens_of(r)) for r in cold}) == len(PROMPTS)  # four prompts, four replies
    assert [cached_tokens(r) for r in cold] == [0] * len(PROMPTS)
    assert [cached_tokens(r) for r in batched] == [cached_tokens(r) for r in warm]  # the same start
    for i, (mine, theirs) in enumerate(zip(warm, batched)):
        if served.scheme == "fp16":
            assert tokens_of(theirs) == tokens_of(mine), f"prompt {i} batched: {divergence(mine, theirs)}"
        else:
            gap = divergence_gap(mine, theirs)
            assert gap is None or gap < NEAR_TIE, f"prompt {i} batched, gap {gap}: {divergence(mine, theirs)}"
    # One after another the four take 4 x 12 steps; all together about 13. How many arrive
    # in time to share steps depends on thread scheduling (a neighbouring server may be
    # starting on the same cores), so what is pinned is that some steps decoded several rows:
    # without that, the comparison above would not have tested batching at all.
    assert batched_steps < len(PROMPTS) * MAX_TOKENS
    if served.scheme == "fp16":
        for i, (mine, theirs) in enumerate(zip(cold, warm)):
            assert tokens_of(theirs) == tokens_of(mine), f"prompt {i} from the cache: {divergence(mine, theirs)}"


def test_prefix_cache_serves_the_next_turn_across_a_restart(served, default_model_dir):
    """Turn 1: A -> R. Turn 2, A + R + B, starts from a cached prefix (A, or A plus R as far
    as it was fed); sent again, from what is cached then; after a restart, from that same
    prefix read from disk, with the same tokens."""
    first = served.complete(A, 8)
    assert first["choices"][0]["finish_reason"] == "length"
    reply = known_ids(default_model_dir, tokens_of(first))  # every model here has its tokenizer
    prompt = A + reply + B
    turn2 = served.complete(prompt, 8)
    assert cached_tokens(turn2) in {len(A), len(A) + len(reply) - 1, len(A) + len(reply)}, \
        (cached_tokens(turn2), len(A), len(reply))
    again = served.complete(prompt, 8)
    assert cached_tokens(again) >= cached_tokens(turn2)
    assert served.stop() == 0, served.log_tail()  # the engine finishes and flushes the disk writer
    served.start()
    restarted = served.complete(prompt, 8)
    assert cached_tokens(restarted) == cached_tokens(again)
    assert tokens_of(restarted) == tokens_of(again), divergence(again, restarted)
    if served.scheme == "fp16":
        assert tokens_of(restarted) == tokens_of(turn2), divergence(turn2, restarted)


def test_an_architecture_without_a_cache_is_refused_at_start_up(models, tmp_path):
    """Llama 4's chunked attention has no kvserve cache: ``kvserve serve`` exits before it
    listens, with one line naming the layer and mlx-lm's cache class (not a 500 per request).
    The one start-up refusal here run as a process: the others raise the same kind of error
    (``ModelLoadError``) from the same step, the model load that ``Engine.start`` re-raises,
    so they are checked in this process (``refused_at_start_up``)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "kvserve.server.cli", "serve", "--model", str(models("llama4")),
         "--cache-dir", str(tmp_path), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvserve: error:")]
    assert lines == [f"kvserve: error: {models('llama4').name} cannot be served: layer 0: "
                     "mlx-lm's ChunkedKVCache (no kvserve cache for this layer kind)"], result.stderr


def refused_at_start_up(model: Path, *args: str) -> str:
    """``kvserve serve --model MODEL ARGS`` in this process (``InProcessServer``), which must
    fail before it listens with a ``ModelLoadError``: the error the command prints as its
    one line before it exits 1 (as the Llama 4 process above does). Its message, checked to
    be one line."""
    from kvserve.server.models.errors import ModelLoadError

    server = InProcessServer(model, *args)
    try:
        with pytest.raises(RuntimeError, match="server exited with 1"):
            server.wait_ready(timeout=120)
    finally:
        server.stop()
    assert isinstance(server.error, ModelLoadError), server.output()
    message = str(server.error)
    assert "\n" not in message, message
    return message


def _other_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of a model directory whose tokenizer swaps the ids of two tokens."""
    shutil.copytree(src, dst)
    data = json.loads((dst / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (1000, 1001))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize("draft,reason", [("lfm2", "recurrent-state layers"), ("other-tokenizer", "another tokenizer")])
def test_a_draft_model_that_cannot_propose_is_refused_at_start_up(models, tmp_path, draft, reason):
    """``--speculative draft``: a draft whose recurrent layers cannot drop rejected tokens,
    or whose tokenizer gives other ids, is refused before the server listens, in one line."""
    path = models(draft) if draft != "other-tokenizer" else _other_tokenizer(models("llama"), tmp_path / "d")
    message = refused_at_start_up(models("llama"), "--cache-dir", str(tmp_path / "c"),
                                  "--speculative", "draft", "--draft-model", str(path))
    assert message.startswith(f"draft model {path.name} ") and reason in message, message


def test_speculation_on_a_model_with_a_state_beside_attention_is_refused_at_start_up(models, tmp_path):
    """Falcon-H1 runs a Mamba state and attention side by side in one layer, which verifies a
    chunk at once: its state cannot roll back row by row, so ``--speculative ngram`` is
    refused before it listens, with one line that says why. (Layers of a state alone verify
    position by position: ``tests/test_speculative.py``.)"""
    message = refused_at_start_up(models("falcon_h1"), "--cache-dir", str(tmp_path), "--speculative", "ngram")
    assert "speculative decoding needs layers that can drop rejected tokens" in message \
        and "recurrent-state layers beside attention in one layer ((state2|kv)*2)" in message, message


def test_a_recurrent_model_served_with_prompt_lookup_answers_as_without(models, tmp_path):
    """Qwen3.5 (GatedDeltaNet layers beside full attention) over HTTP with ``--speculative
    ngram``: prompts that repeat themselves get guesses verified position by position through
    the recurrent layers, and every greedy reply equals the plain server's. (Both servers run
    in this process: ``InProcessServer``.)"""
    servers = {mode: InProcessServer(models("qwen3_5"), "--cache-dir", str(tmp_path / mode), "--speculative", mode,
                                     "--prompt-cache-disk-gb", "0") for mode in ("off", "ngram")}
    try:
        for proc in servers.values():
            proc.wait_ready(timeout=120)
        base = prompt_tokens(7, 10)
        bodies = [{"model": "default", "prompt": (base * 6)[: 30 + 7 * i], "max_tokens": 40, "temperature": 0}
                  for i in range(3)]
        with httpx.Client(timeout=TIMEOUT) as client:
            replies = {mode: [client.post(f"{proc.base_url}/v1/completions", json=b).json()
                              ["choices"][0]["text"] for b in bodies] for mode, proc in servers.items()}
        assert replies["ngram"] == replies["off"]
        counts = metrics(servers["ngram"].base_url)
        proposed = sum(v for k, v in counts.items() if k.startswith("kvserve_speculative_proposed_tokens_total"))
        accepted = sum(v for k, v in counts.items() if k.startswith("kvserve_speculative_accepted_tokens_total"))
        assert 0 < accepted < proposed
    finally:
        for proc in servers.values():
            assert proc.stop() == 0, proc.output()
