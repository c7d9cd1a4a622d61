"""The device profile: what serves on the device this process computes on, chosen once at
start-up, logged, and shown in ``/v1/models``.

kvserve's CPU speed comes from rewrites of the model made for the CPU (``fastpath``: a
RoPE from a shared cos/sin table, norms, linears and SwiGLU as one CPU operation each). On
a GPU MLX's ``mx.fast`` kernels already do that work, and the table RoPE is slower there
(a served run on an H200 gave TPOT 43 ms without it, 47 with it), so a GPU profile keeps
the model's own modules but for one rewrite made for the GPU: on CUDA a small model's step
is bound by the host launching kernels, and ``fused_projections`` computes a layer's q, k
and v (and its MLP's gate and up) as one matmul each (``projections.py``), and ``few_rows_qmv``
multiplies a decode step's few rows with quantized weights in kvserve's kernel, where MLX's
tiled GEMM read the weights at 3% of an H200's bandwidth (``few_rows.py``). Metal keeps the
model's modules, unmeasured there. A GPU also compiles kernels at first use (NVRTC on CUDA, the
first call of each fused attention kernel checks itself against the reference): its
profile warms the engine up before the server says ready, and keeps compiled kernels in
a directory under the cache dir so a restarted server reuses them.

    >>> p = profile_for("cpu")
    >>> p.rewrites, p.warmup, p.describe()
    (('table_rope', 'cpu_ops'), False, 'cpu: rewrites table_rope, cpu_ops; prompt chunks of 256; no warm-up')
    >>> g = profile_for("cuda", kernel_cache="/c/kernels/mlx-0.32.4/sm_90")
    >>> g.rewrites, g.warmup, g.describe()
    (('fused_projections', 'few_rows_qmv'), True, 'cuda: rewrites fused_projections, few_rows_qmv; prompt chunks of 1024; captured decode steps; warm-up before ready; kernels kept in /c/kernels/mlx-0.32.4/sm_90')
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# The MLX CUDA backend reads its compiled-kernel folder from here at its first compile.
KERNEL_CACHE_ENV = "MLX_PTX_CACHE_DIR"
CPU_REWRITES = ("table_rope", "cpu_ops")
REWRITES = {"cpu": CPU_REWRITES, "cuda": ("fused_projections", "few_rows_qmv"), "metal": ()}
# Where decode steps are captured once per batch shape and replayed (``captured.py``): a GPU,
# whose small-model step is the host building its graph. On the CPU the kernels are most of
# a step: building 8 rows of the default model at 300 tokens takes 5.0 ms (fp16), 3.0
# captured (``bench/gpu_engine_split.py --device cpu --captured both``), of a step of some
# 60 ms, and ``mx.compile`` would compile C++ with the system compiler at first use.
CAPTURED = {"cpu": False, "cuda": True, "metal": False}
# Prompt tokens per forward pass where the config leaves it unset. The CPU measured fastest
# at 256. On CUDA a prompt's products run on the weights dequantized once per chunk
# (``few_rows.DENSE_ROWS``), so longer chunks pay that once for more tokens: an 8,000-token
# prompt of the Llama-3-8B shape (4-bit, H100) prefilled in 272 ms a request at 1024
# against 775 ms at 256 (docs/benchmarks/gpu-serve.md, thirteenth round). Metal is unmeasured.
PREFILL_STEP = {"cpu": 256, "cuda": 1024, "metal": 256}


@dataclass(frozen=True)
class DeviceProfile:
    """``backend``: "cpu", "cuda" or "metal"; ``rewrites``: the ``fastpath`` rewrites
    applied to the model; ``warmup``: serve every kernel once before ready;
    ``kernel_cache``: where compiled kernels persist ("" where the device compiles none
    that MLX keeps); ``captured``: decode steps captured once per batch shape and replayed."""

    backend: str
    rewrites: tuple[str, ...]
    warmup: bool
    kernel_cache: str = ""
    prefill_step_size: int = PREFILL_STEP["cpu"]  # where the config leaves it unset
    captured: bool = False

    def describe(self) -> str:
        rewrites = f"rewrites {', '.join(self.rewrites)}" if self.rewrites else "no rewrites"
        warm = "warm-up before ready" if self.warmup else "no warm-up"
        kept = f"; kernels kept in {self.kernel_cache}" if self.kernel_cache else ""
        steps = "; captured decode steps" if self.captured else ""
        return f"{self.backend}: {rewrites}; prompt chunks of {self.prefill_step_size}{steps}; {warm}{kept}"

    def card(self) -> dict:
        """The profile as ``/v1/models`` shows it."""
        return {"backend": self.backend, "rewrites": list(self.rewrites), "warmup": self.warmup,
                "prefill_step_size": self.prefill_step_size, "captured_decode": self.captured}


def profile_for(backend: str, warmup: str = "auto", kernel_cache: str = "",
                prefill_step_size: int | None = None, captured: str = "auto") -> DeviceProfile:
    """The profile of ``backend``; ``warmup`` "on"/"off" overrides the device's default
    ("auto": on where kernels compile at first use, i.e. on a GPU), ``captured`` likewise
    (``CAPTURED``), and a configured ``prefill_step_size`` the device's chunk (so the profile
    shows what is served).

        >>> profile_for("cuda").prefill_step_size, profile_for("cuda", prefill_step_size=64).prefill_step_size
        (1024, 64)
    """
    on_gpu = backend != "cpu"
    warm = on_gpu if warmup == "auto" else warmup == "on"
    replay = CAPTURED[backend] if captured == "auto" else captured == "on"
    return DeviceProfile(backend, REWRITES[backend], warm, kernel_cache if on_gpu else "",
                         prefill_step_size or PREFILL_STEP[backend], replay)


def choose_profile(cache_dir: Path, warmup: str = "auto", prefill_step_size: int | None = None,
                   captured: str = "auto") -> DeviceProfile:
    """The profile of MLX's default device. On CUDA this also points MLX's compiled-kernel
    cache at ``cache_dir/kernels/mlx-<version>/<device>`` (one folder per MLX version and
    device: a kernel compiled for one architecture must not load on another), unless the
    operator set ``MLX_PTX_CACHE_DIR``; call it before the first kernel compiles."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return profile_for("cpu", warmup, prefill_step_size=prefill_step_size, captured=captured)
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return profile_for("metal", warmup, prefill_step_size=prefill_step_size, captured=captured)
    folder = os.environ.get(KERNEL_CACHE_ENV)
    if not folder:
        folder = str(cache_dir / "kernels" / f"mlx-{mx.__version__}" / _device_tag())
        Path(folder).mkdir(parents=True, exist_ok=True)
        os.environ[KERNEL_CACHE_ENV] = folder
    return profile_for("cuda", warmup, folder, prefill_step_size, captured)


def kernel_files(profile: DeviceProfile) -> int:
    """Compiled kernels in the profile's cache folder: each compile at run time adds files,
    so a count that does not grow while requests are served shows none waited on one."""
    if not profile.kernel_cache or not Path(profile.kernel_cache).is_dir():
        return 0
    return sum(1 for _ in Path(profile.kernel_cache).iterdir())


def _device_tag() -> str:
    """A folder name for this GPU: its architecture where MLX reports it, else its name.

        >>> _clean("NVIDIA H200 / sm_90")
        'NVIDIA_H200_sm_90'
    """
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:  # older MLX: no device_info
        info = {}
    tag = str(info.get("architecture") or info.get("device_name") or "gpu")
    return _clean(tag)


def _clean(tag: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", tag).strip("_") or "gpu"
