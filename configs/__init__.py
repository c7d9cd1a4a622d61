"""Frozen configuration for every subsystem, loaded from TOML presets and CLI overrides.

This package is the only place that reads ``os.environ``. Everything else receives a
``ServerConfig`` (or one of its parts) and never sees an argparse ``Namespace``.

Example:
    >>> cfg = load_config(None, {"http.port": 9000, "engine.max_tokens": 64})
    >>> (cfg.http.host, cfg.http.port, cfg.engine.max_tokens)
    ('127.0.0.1', 9000, 64)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

PRESETS_DIR = Path(__file__).parent


class ConfigError(ValueError):
    """A configuration value or file that cannot be used; the message is one line."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to serve; ``None`` means the default model (SmolLM2-135M-Instruct)."""

    model: str | None = None
    cache_dir: str | None = None
    # "auto" measures the candidates at start-up; a fixed name skips the measurement.
    weight_format: str = "auto"

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()


@dataclass(frozen=True)
class EngineConfig:
    """Limits of the engine thread. Values are per request unless named otherwise."""

    max_tokens: int = 512  # used when a request gives no max_tokens
    max_tokens_limit: int = 8192  # the largest max_tokens a request may ask for
    # Prompt tokens per forward pass. None: the device profile's (``server/engine/device.py``:
    # 256 on the CPU, measured fastest there; 1024 on CUDA, where a long prompt prefilled 2.9x
    # faster than at 256).
    prefill_step_size: int | None = None
    max_queued_requests: int = 64  # waiting requests beyond this get 429
    max_batch_size: int = 8  # requests running together (prefilling or decoding)
    # Tokens one step may compute: each decoding request costs 1, prefill chunks share the
    # rest, so a long prompt delays the running streams by at most one chunk per step.
    # None: prefill_step_size (or max_batch_size when larger), once known.
    max_step_tokens: int | None = None
    # Bytes the KV caches of all live requests may hold together (an int, or a size such as
    # "2GiB"); admission and preemption count each request's tokens at what a token costs in
    # the served scheme (a scheme that stores fewer bytes admits more rows), and past the
    # budget the latest decoding request is preempted (its cache swapped to disk) until room
    # returns. None: a quarter of the machine's memory (``kv_memory.DEFAULT_SHARE``).
    kv_memory: int | str | None = None
    # Seconds a request may wait in the queue before it is answered with a queue_timeout
    # error (a client would rather retry elsewhere than wait on); 0: no limit.
    queue_timeout_s: float = 600.0
    # Speculative decoding: "off", "ngram" (propose the continuation of the latest earlier
    # match of a request's own last tokens) or "draft" (a smaller model with the same
    # tokenizer, ``draft_model``, proposes); each decoding row verifies up to
    # ``num_draft_tokens`` proposals in one forward.
    speculative: str = "off"
    num_draft_tokens: int = 4
    draft_model: str | None = None
    # A decode step of the draft as a share of one of the served model (0.1: a tenth). None:
    # measured at start-up, which a machine busy with other work can overstate (and then no
    # row proposes); set it to pin the choice of how many positions are verified.
    draft_cost: float | None = None
    # Split the model across the processes ``mlx.launch`` started (tensor parallel over
    # mx.distributed): rank 0 serves HTTP and plans, every rank computes its shard.
    distributed: bool = False
    # Serve a batch of requests to the engine itself before /health says ready, so no client
    # request waits on a kernel compile: "auto" does it where kernels compile at first use
    # (a GPU; the device profile, ``server/engine/device.py``), "on" and "off" everywhere.
    warmup: str = "auto"
    # Capture decode steps once per batch shape and replay them (``mx.compile``): "auto" where
    # the host building a step's graph is what a step waits on (a GPU), "on" and "off" anywhere.
    captured_decode: str = "auto"

    def step_sizes(self, device_step: int) -> tuple[int, int]:
        """(prefill_step_size, max_step_tokens), ``device_step`` where the config leaves the
        chunk size to the device profile.

            >>> EngineConfig().step_sizes(1024), EngineConfig(prefill_step_size=64).step_sizes(1024)
            ((1024, 1024), (64, 64))
            >>> EngineConfig(max_step_tokens=300).step_sizes(1024)
            (1024, 300)
        """
        step = self.prefill_step_size or device_step
        return step, self.max_step_tokens or max(step, self.max_batch_size)

    def __post_init__(self) -> None:
        _require(self.warmup in ("auto", "on", "off"), f"engine.warmup must be auto, on or off, got {self.warmup!r}")
        _require(self.captured_decode in ("auto", "on", "off"),
                 f"engine.captured_decode must be auto, on or off, got {self.captured_decode!r}")
        _require(1 <= self.max_tokens <= self.max_tokens_limit,
                 "engine.max_tokens must be between 1 and engine.max_tokens_limit")
        _require(self.prefill_step_size is None or self.prefill_step_size >= 1,
                 "engine.prefill_step_size must be >= 1")
        _require(self.max_queued_requests >= 1, "engine.max_queued_requests must be >= 1")
        _require(self.max_batch_size >= 1, "engine.max_batch_size must be >= 1")
        if self.max_step_tokens is None and self.prefill_step_size is not None:
            object.__setattr__(self, "max_step_tokens", max(self.prefill_step_size, self.max_batch_size))
        # Every decoding request must fit in one step, or a stream would skip steps.
        _require(self.max_step_tokens is None or self.max_step_tokens >= self.max_batch_size,
                 "engine.max_step_tokens must be >= engine.max_batch_size")
        if self.kv_memory is not None:
            object.__setattr__(self, "kv_memory", parse_size(self.kv_memory, "engine.kv_memory"))
        _require(self.queue_timeout_s >= 0, "engine.queue_timeout_s must be >= 0 (0: no limit)")
        _require(self.speculative in ("off", "ngram", "draft"),
                 f"engine.speculative must be off, ngram or draft, got {self.speculative!r}")
        _require((self.speculative == "draft") == bool(self.draft_model),
                 "engine.speculative = draft needs engine.draft_model, and engine.draft_model needs it")
        _require(not (self.draft_model and self.distributed),
                 "engine.draft_model cannot be used with engine.distributed (each process would "
                 "run its own draft)")
        _require(self.draft_cost is None or 0 <= self.draft_cost, "engine.draft_cost must be >= 0")
        # Sliding windows keep 16 slots past the window: a verify chunk must fit in them.
        _require(1 <= self.num_draft_tokens <= 15, "engine.num_draft_tokens must be between 1 and 15")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache scheme for every request (``kvserve.cache.scheme`` has the grammar) and the
    prefix cache: prompt caches kept in RAM, spilled to files that survive restarts."""

    kv_scheme: str = "fp16"
    # 0: no RAM tier; None: an eighth of the machine's memory, at least 1 GiB (a GPU serving
    # an 8B model keeps a 16K-token fp16 prompt, 2 GiB, where a fixed 1 GiB kept none).
    prompt_cache_ram_gb: float | None = None
    prompt_cache_disk_gb: float = 8.0  # 0: no SSD tier
    # None: <model cache dir>/prompt-cache/<model, tokenizer and scheme>; one directory per
    # namespace, as files of another namespace are evicted first.
    prompt_cache_dir: str | None = None
    # Models with sliding-window or recurrent-state layers: while a prompt is prefilled, the
    # prefix cache keeps those layers every N tokens too (besides each message's end and
    # the last prompt token), so a long prompt that parts from a cached one mid-message
    # resumes within N tokens. 0: message ends and the last token only.
    prompt_cache_checkpoint_tokens: int = 1024

    def __post_init__(self) -> None:
        _require(self.prompt_cache_checkpoint_tokens >= 0, "cache.prompt_cache_checkpoint_tokens must be >= 0")
        _require(self.prompt_cache_ram_gb is None or self.prompt_cache_ram_gb >= 0,
                 "cache.prompt_cache_ram_gb must be >= 0")
        _require(self.prompt_cache_disk_gb >= 0, "cache.prompt_cache_disk_gb must be >= 0")

    @property
    def prefix_enabled(self) -> bool:
        return self.prompt_cache_ram_gb != 0 or self.prompt_cache_disk_gb > 0


@dataclass(frozen=True)
class HTTPConfig:
    host: str = "127.0.0.1"  # loopback unless the operator opens it on purpose
    port: int = 8000
    log_level: str = "info"
    # Bearer key every route but /health requires; None: no authentication (loopback use).
    api_key: str | None = None
    # Origins allowed to call from a browser; empty: no CORS headers at all.
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20  # larger bodies get 413 before they are parsed
    max_header_bytes: int = 16 << 10  # the request line and headers together (HTTP parser)
    # SIGTERM: how long in-flight requests may run on before they are aborted.
    drain_timeout_s: float = 30.0
    # A stream with nothing to send (queued, or a long prefill) gets an SSE comment this
    # often, so proxies that close idle connections (often after 30-60 s) keep it open.
    sse_keepalive_s: float = 15.0
    # Names a request's ``model`` may take besides the model's own id and "default", shell-
    # style patterns allowed ("claude-*", "*"): agent clients send the name their config holds.
    served_model_names: tuple[str, ...] = ()
    # Responses API: how many responses are kept for GET /v1/responses/{id} and
    # previous_response_id (in <cache dir>/responses/responses.sqlite3, across restarts),
    # the oldest evicted first; each holds its whole conversation. 0: none is stored.
    max_stored_responses: int = 1000

    def __post_init__(self) -> None:
        object.__setattr__(self, "served_model_names", tuple(self.served_model_names))
        _require(all(isinstance(n, str) and n for n in self.served_model_names),
                 "http.served_model_names must be non-empty strings")
        _require(0 <= self.port <= 65535, f"http.port must be in 0..65535, got {self.port}")
        _require(self.api_key is None or len(self.api_key) >= 8,
                 "http.api_key must have at least 8 characters")
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins))
        _require(self.max_body_bytes >= 1024, "http.max_body_bytes must be >= 1024")
        _require(self.max_header_bytes >= 1024, "http.max_header_bytes must be >= 1024")
        _require(self.drain_timeout_s >= 0, "http.drain_timeout_s must be >= 0")
        _require(self.sse_keepalive_s > 0, "http.sse_keepalive_s must be > 0")
        _require(self.max_stored_responses >= 0, "http.max_stored_responses must be >= 0 (0: none stored)")


@dataclass(frozen=True)
class ServerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    http: HTTPConfig = field(default_factory=HTTPConfig)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | float | str, name: str = "size") -> int:
    """Bytes from an int or a size with a unit; K, M, G, T are powers of 1024, with or
    without "B" or "iB" after them. Must be at least 1 MiB.

        >>> parse_size("2GiB"), parse_size("512M"), parse_size("1.5g"), parse_size(4 << 20)
        (2147483648, 536870912, 1610612736, 4194304)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = int(value)
    else:
        text = str(value).strip().lower().removesuffix("ib").removesuffix("b").strip()
        number, unit = (text[:-1], text[-1]) if text[-1:] in ("k", "m", "g", "t") else (text, "")
        try:
            size = int(float(number) * _UNITS[unit])
        except ValueError:
            raise ConfigError(f"{name} must be a size such as 2GiB or 512MiB, got {value!r}") from None
    _require(size >= 1 << 20, f"{name} must be at least 1 MiB, got {value!r}")
    return size


def default_cache_dir() -> Path:
    """``$KVSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvserve``, else the platform's
    user cache folder (``~/Library/Caches/kvserve`` on macOS, ``~/.cache/kvserve``)."""
    if explicit := os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "kvserve"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "kvserve"
    return Path.home() / ".cache" / "kvserve"


@dataclass(frozen=True)
class BlasSettings:
    """How the CPU BLAS is set up before mlx loads (environment, since no config file is read
    yet): ``KVSERVE_FAST_BLAS=0`` keeps MLX's bundled reference BLAS, ``KVSERVE_BLAS_THREADS``
    sets OpenBLAS's thread count (default: the usable cores), ``CC`` the compiler of the shim."""

    enabled: bool = True
    threads: int | None = None
    compiler: str | None = None
    cache_dir: Path = field(default_factory=lambda: default_cache_dir() / "blas")


def blas_settings() -> BlasSettings:
    flag = os.environ.get("KVSERVE_FAST_BLAS", "1").strip().lower()
    threads = os.environ.get("KVSERVE_BLAS_THREADS", "").strip()
    _require(not threads or threads.isdigit(), f"KVSERVE_BLAS_THREADS must be an integer, got {threads!r}")
    return BlasSettings(enabled=flag not in ("0", "false", "no", "off"),
                        threads=int(threads) if threads else None,
                        compiler=os.environ.get("CC") or None)


def ring_hosts() -> tuple[int, list[list[str]]] | None:
    """This process's rank and each rank's ``"ip:port"`` addresses, from what ``mlx.launch
    --backend ring`` sets (``MLX_RANK``; ``MLX_HOSTFILE``, JSON: one list of addresses per
    rank); None when the process was not started so, or the file cannot be read."""
    import json

    rank, hostfile = os.environ.get("MLX_RANK", ""), os.environ.get("MLX_HOSTFILE", "")
    if not rank.isdigit() or not hostfile:
        return None
    try:
        ring = json.loads(Path(hostfile).read_text())
        return int(rank), [[str(a) for a in addresses] for addresses in ring]
    except (OSError, ValueError, TypeError):
        return None


def preset_path(name: str) -> Path:
    """``default`` -> the packaged ``configs/default.toml``; a path is returned as is."""
    path = Path(name)
    if path.suffix == ".toml" and path.exists():
        return path
    packaged = PRESETS_DIR / f"{path.stem}.toml"
    _require(packaged.exists(), f"config file not found: {name}")
    return packaged


def load_config(path: str | Path | None, overrides: Mapping[str, Any] | None = None) -> ServerConfig:
    """Read a TOML preset (sections ``model``, ``engine``, ``cache``, ``http``), apply dotted overrides.

    Overrides whose value is ``None`` are ignored, so CLI flags that were not given fall
    through to the file. Unknown sections or keys are errors, not silently dropped.
    """
    data: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            data = tomllib.loads(preset_path(str(path)).read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"invalid TOML in {path}: {exc}") from None
    for dotted, value in (overrides or {}).items():
        if value is not None:
            section, key = dotted.split(".", 1)
            data.setdefault(section, {})[key] = value
    return _build(data)


def _build(data: Mapping[str, Any]) -> ServerConfig:
    sections = {f.name: f.type for f in dataclasses.fields(ServerConfig)}
    unknown = set(data) - set(sections)
    _require(not unknown, f"unknown config section(s): {', '.join(sorted(unknown))}")
    parts = {}
    for name, cls in (("model", ModelConfig), ("engine", EngineConfig), ("cache", CacheConfig),
                      ("http", HTTPConfig)):
        values = dict(data.get(name, {}))
        known = {f.name for f in dataclasses.fields(cls)}
        bad = set(values) - known
        _require(not bad, f"unknown key(s) in [{name}]: {', '.join(sorted(bad))}")
        try:
            parts[name] = cls(**values)
        except TypeError as exc:
            raise ConfigError(f"[{name}]: {exc}") from None
    return ServerConfig(**parts)
