"""Attention kernels over each KV storage format, and the CPU primitives a layer needs.

    reference.py    pure-MLX attention: ``attend_full`` (one score matrix over the whole
                    context) and ``attend_blockwise`` (online softmax over blocks of T; the
                    reference every fused kernel is tested against)
    dispatch.py     ``attend``: the entry point the caches call; picks a verified fused
                    kernel, the full path or the blockwise reference by device and T
    cuda_attention.py  fused split-context attention on NVIDIA GPUs (``mx.fast.cuda_kernel``)
                    for L <= 256 over affine, mxfp4, TurboQuant and raw K/V; its device code is
                    cuda_source.py
    cpu_attention.py  fused attention over stored K/V on the CPU, an MLX primitive in C++
                    (cpu_attention.cpp) for decode, verify and prompt chunks
    cpu_ops.py      RMSNorm, table RoPE, linear, SwiGLU and TurboQuant encoding as one CPU
                    operation each (cpu_ops.cpp): a small model's decode step is bound by
                    MLX's cost per operation
    cpu_build.py    builds those C++ extensions once per machine (MLX's headers, nanobind)
    bench.py        ``kvserve bench-attention`` (measurements in bench_cases.py)

The caches' own full-context functions (``kvserve.cache.affine.attend_quantized``,
``kvserve.cache.turbo_codec.attend_encoded``) stay as the per-family oracles in tests.
"""
