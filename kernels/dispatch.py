"""The one attention entry point the caches call, and the rule that picks an implementation.

    attend(queries, key_fmt, keys, value_fmt, values, scale, mask, key_scale=None)

``key_fmt`` / ``value_fmt`` follow the format protocol of ``kvserve.kernels.reference``;
``keys`` / ``values`` are the stored parts (B, H_kv, T, W); queries (B, H_q, L, D); the
result is (B, H_q, L, D_v) in the queries' dtype. Choice, in order:

1. a registered fused kernel for this device and these formats, if it is *trusted*: either
   its own tests ran on this kind of device (``verified_on``), or its first call in this
   process matched the blockwise reference (``self_check``); a kernel that fails the check
   is never used again in the process and a warning is logged;
2. on the CPU, ``attend_full`` while T <= ``CPU_FULL_MAX_T``, where one score matrix is
   cheaper than a Python loop over blocks;
3. on the CPU, ``attend_blockwise`` (the reference) otherwise; on a GPU, ``attend_dense``
   (the context decoded to the queries' dtype, then MLX's fused SDPA), since the reference's
   ``quantized_matmul`` takes no f32 activations on CUDA and would have to run on the CPU.

Crossover, measured on this project's 2-core x86-64 Xeon (MLX 0.32.4 CPU, OpenBLAS
enabled; B=8, 32 query heads over 8 KV heads, D=128, L=1, block 256), median ms per call,
full / blockwise:

    T       affine4         turbo0v4        turbo8v3
    256     7.9 / 8.0       23.4 / 24.0     43.2 / 33.9   (one block: the same ops)
    512     15.7 / 16.9     53.1 / 62.2     68.3 / 67.4
    1024    31.8 / 33.8     110.0 / 127.0   144.1 / 149.1
    2048    63.8 / 69.4     301.2 / 236.0   348.1 / 300.0
    4096    132.2 / 140.7   677.4 / 488.0   777.4 / 533.0

The turbo formats cross over between 1024 and 2048 tokens (the full path decodes (B, H_kv, T, D)
f32 centroids for the whole context at once); affine/MX formats stay ~6% faster on the full path,
but its transients grow with T, so past 1024 tokens the bounded memory of the blockwise walk
is worth those 6% (affine4 at T=4096: 3.4 MiB above the stored K/V against
12.3 MiB for the full path; turbo8v3: 44 against 648 MiB; docs/benchmarks/attention-cpu.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from kvserve.kernels.reference import attend_blockwise, attend_dense, attend_full, format_key

log = logging.getLogger(__name__)

CPU_FULL_MAX_T = 1024  # the crossover above: full path up to here, blockwise beyond
# Max abs difference against the reference, per output dtype, for outputs of unit scale
# (larger outputs scale it): the GPU grid's bounds. f16/bf16 kernels multiply in the
# activation dtype on tensor cores; the reference decodes and multiplies in f32.
SELF_CHECK_ATOL = {mx.float32: 2e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}


@dataclass
class FusedKernel:
    """A fused attention kernel (CUDA or Metal) and what it is known to be correct on.

    ``supports(key_fmt, value_fmt, L)`` says which calls it serves; ``fn`` has the
    signature of ``attend``; ``verified_on`` lists device types ("gpu") whose test runs
    the kernel passed; anywhere else it must pass ``self_check`` first.
    """

    name: str
    device: mx.DeviceType
    supports: Callable[..., bool]
    fn: Callable[..., mx.array]
    verified_on: tuple[mx.DeviceType, ...] = ()
    checked: bool | None = field(default=None, compare=False)  # None: not yet self-checked
    checked_sinks: bool | None = field(default=None, compare=False)  # the same, calls with sinks

    def verdict(self, sinks: bool) -> bool | None:
        """The self-check's verdict for calls with or without attention sinks (their merge
        differs, so each is checked on its own first call)."""
        return self.checked_sinks if sinks else self.checked


_KERNELS: list[FusedKernel] = []
# (device, format keys, L) -> the registered kernels that support such calls, in order:
# ``supports`` looks at format objects only, and attention runs once per layer per step.
_CANDIDATES: dict[tuple, tuple[FusedKernel, ...]] = {}


def register_kernel(kernel: FusedKernel) -> None:
    """Offer a fused kernel to the dispatch (the later CUDA/Metal kernels call this)."""
    _KERNELS.append(kernel)
    _CANDIDATES.clear()


def unregister_kernel(name: str) -> None:
    _KERNELS[:] = [k for k in _KERNELS if k.name != name]
    _CANDIDATES.clear()


def reference(*args, **kwargs) -> mx.array:
    """The blockwise reference on the CPU stream, whatever the default device: it is the
    oracle the kernels are tested against there, and on a GPU some of its ops have no
    kernel (MLX's CUDA ``quantized_matmul`` takes no f32 activations)."""
    with mx.stream(mx.cpu):
        out = attend_blockwise(*args, **kwargs)
        mx.eval(out)
    return out


def self_check(kernel: FusedKernel, args: tuple, kwargs: dict) -> bool:
    """Run ``kernel`` and the blockwise reference on the same call; remember the verdict."""
    try:
        got = kernel.fn(*args, **kwargs)
        want = reference(*args, **kwargs).astype(mx.float32)
        tol = SELF_CHECK_ATOL.get(got.dtype, 2e-4) * max(1.0, mx.max(mx.abs(want)).item())
        got = got.astype(mx.float32)
        ok = got.shape == want.shape and mx.max(mx.abs(got - want)).item() <= tol
    except Exception as exc:  # noqa: BLE001 (a kernel that does not run is as untrusted as a wrong one)
        log.warning("attention kernel %s raised during its self-check: %s", kernel.name, exc)
        ok = False
    if not ok:
        log.warning("attention kernel %s failed its self-check against the reference; "
                    "using the pure-MLX reference instead", kernel.name)
    setattr(kernel, "checked_sinks" if "sinks" in kwargs else "checked", ok)
    return ok


def _fused_for(device: mx.DeviceType, key_fmt, value_fmt, L: int,
               sinks: bool = False) -> FusedKernel | None:
    key = (device, format_key(key_fmt), format_key(value_fmt), L)
    candidates = _CANDIDATES.get(key)
    if candidates is None:
        candidates = _CANDIDATES[key] = tuple(
            k for k in _KERNELS if k.device == device and k.supports(key_fmt, value_fmt, L))
    for kernel in candidates:
        if kernel.verdict(sinks) is not False:
            return kernel
    return None


def choose(key_fmt, value_fmt, L: int, T: int, device: mx.DeviceType | None = None) -> str:
    """Name of what ``attend`` runs for this call: a kernel's name, "full" or "blockwise".

        >>> choose(None, None, 1, 100, mx.cpu), choose(None, None, 1, 1 << 16, mx.cpu)
        ('full', 'blockwise')
    """
    device = mx.default_device().type if device is None else device
    kernel = _fused_for(device, key_fmt, value_fmt, L)
    if kernel is not None:
        return kernel.name
    if device == mx.cpu and T <= CPU_FULL_MAX_T:
        return "full"
    return "blockwise" if device == mx.cpu else "dense"


def attend(queries: mx.array, key_fmt, keys: tuple[mx.array, ...], value_fmt,
           values: tuple[mx.array, ...], scale: float, mask: Any,
           key_scale: mx.array | None = None, sinks: mx.array | None = None) -> mx.array:
    """Attention over stored K/V parts by the implementation ``choose`` names; ``sinks``
    (one logit per query head, gpt-oss) reach every implementation."""
    args = (queries, key_fmt, keys, value_fmt, values, scale, mask)
    kwargs = {"key_scale": key_scale} if sinks is None else {"key_scale": key_scale, "sinks": sinks}
    device = mx.default_device().type
    kernel = _fused_for(device, key_fmt, value_fmt, queries.shape[2], sinks is not None)
    if kernel is not None:
        trusted = (device in kernel.verified_on or kernel.verdict(sinks is not None)
                   or self_check(kernel, args, kwargs))
        if trusted:
            return kernel.fn(*args, **kwargs)
    if device == mx.cpu and keys[0].shape[2] <= CPU_FULL_MAX_T:
        return attend_full(*args, **kwargs)
    return attend_blockwise(*args, **kwargs) if device == mx.cpu else attend_dense(*args, **kwargs)


def _register_cuda_kernels() -> None:
    """Offer the CUDA kernels where MLX runs on an NVIDIA GPU. Families listed in
    ``cuda_attention.VERIFIED_ON_GPU`` are trusted there; the others (currently all) must
    pass ``self_check`` on their first call in the process before they serve any."""
    from kvserve.kernels import cuda_attention

    if not cuda_attention.cuda_ready():
        return
    for spec in cuda_attention.kernel_specs():
        verified = (mx.gpu,) if spec["verified"] else ()
        register_kernel(FusedKernel(spec["name"], mx.gpu, spec["supports"], spec["fn"], verified))


_register_cuda_kernels()


def _register_cpu_kernels() -> None:
    """Offer the CPU kernel for stored K/V (``cpu_attention``). Its tests run on every CPU
    this project is tested on; it is built on its first call, and where it cannot be built
    ``supports`` says no and the MLX paths above serve."""
    from kvserve.kernels import cpu_attention

    register_kernel(FusedKernel("cpu-stored", mx.cpu, cpu_attention.supports, cpu_attention.attend_cpu,
                                verified_on=(mx.cpu,)))


_register_cpu_kernels()
