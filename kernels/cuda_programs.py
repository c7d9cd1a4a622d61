"""The CUDA programs this process has compiled for kvserve's kernels, in order.

MLX turns a ``mx.fast.cuda_kernel`` into a program per source, template arguments and
input and output dtypes (the signature it generates spells the dtypes), compiles each with
NVRTC the first time a call needs it, and keeps it in memory only: unlike MLX's own JIT
kernels, none reaches ``MLX_PTX_CACHE_DIR``. So every process compiles every program it
calls (seconds each on an H200's host: a 3-second profile of a served engine found it
compiling one throughout), and one compiled while a request waits stalls every row of the
batch. The warm-up is there to call them all first; this module is how the
engine knows whether it did.

``cuda_kernel`` makes a kernel as ``mx.fast.cuda_kernel`` does, whose calls note each new
program's key (``note``); ``compiled()`` counts the keys, ``since(n)`` lists those after
the first ``n``.

    >>> import mlx.core as mx
    >>> before = compiled()
    >>> note("kvs_demo", [("T", mx.float16)], [mx.ones((2,), mx.float16)], [mx.float32])
    True
    >>> note("kvs_demo", [("T", mx.float16)], [mx.zeros((9,), mx.float16)], [mx.float32])
    False
    >>> note("kvs_demo", [("T", mx.float32)], [mx.ones((2,), mx.float16)], [mx.float32])
    True
    >>> compiled() - before, describe(since(before)[0])
    (2, 'kvs_demo T=float16 (float16) -> (float32)')
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# MLX is imported where a kernel is made: the engine loop, which imports this module, must
# import without MLX (an HTTP front end does).
_programs: list[tuple] = []
_seen: set[tuple] = set()


def note(name: str, template: Sequence[tuple[str, Any]] | None, inputs: Sequence[Any],
         output_dtypes: Sequence[Any]) -> bool:
    """Record the program a call of kernel ``name`` needs; True where it is new to this
    process (MLX compiles it for this call). Shapes do not make programs; dtypes do."""
    key = (name, tuple(template or ()), tuple(a.dtype for a in inputs), tuple(output_dtypes))
    if key in _seen:
        return False
    _seen.add(key)
    _programs.append(key)
    return True


def compiled() -> int:
    """Programs this process has compiled (or is compiling) so far."""
    return len(_programs)


def since(n: int) -> list[tuple]:
    """The keys of the programs after the first ``n``."""
    return _programs[n:]


def describe(key: tuple) -> str:
    """A program's key as a log line reads it: name, template, input and output dtypes."""
    name, template, ins, outs = key
    dt = lambda d: str(d).removeprefix("mlx.core.")  # noqa: E731
    args = " ".join(f"{k}={dt(v)}" for k, v in template)
    return f"{name}{' ' + args if args else ''} ({', '.join(map(dt, ins))}) -> ({', '.join(map(dt, outs))})"


def compact(code: str) -> str:
    r"""CUDA code without its comments, indentation and blank lines: what the compiler reads.

    On every call of a ``mx.fast.cuda_kernel`` MLX hashes the kernel's whole source to find
    its compiled module; a profile of a served engine on an H200 had 6.6-9.0% of the engine
    thread there (``docs/benchmarks/gpu-serve.md``, twenty-fourth round). Compacted, the
    sources are about a quarter shorter, and every program compiles to the same PTX
    (``bench/kernel_ptx.py``: NVRTC over each program the kernels' wrappers launch). String
    literals (the inline PTX) keep their spacing; none holds a comment marker.

        >>> print(compact("  // why\nint a = 1;  // one\n\n/* block\n */  int b;\n"), end="")
        int a = 1;
        int b;
    """
    code = re.sub(r"/\*.*?\*/", "", code, flags=re.S)
    lines = (re.sub(r"//.*", "", line).strip() for line in code.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


class CudaKernel:
    """``mx.fast.cuda_kernel(name=..., **spec)`` over the compacted source and header, whose
    calls ``note`` their programs."""

    __slots__ = ("name", "_kernel")

    def __init__(self, name: str, **spec: Any):
        import mlx.core as mx

        self.name = name
        for part in ("source", "header"):
            if part in spec:
                spec[part] = compact(spec[part])
        self._kernel = mx.fast.cuda_kernel(name=name, **spec)

    def __call__(self, *, inputs: list[Any], output_dtypes: list[Any], **call: Any) -> list[Any]:
        note(self.name, call.get("template"), inputs, output_dtypes)
        return self._kernel(inputs=inputs, output_dtypes=output_dtypes, **call)


cuda_kernel = CudaKernel  # the name kvserve's kernel files call it by
