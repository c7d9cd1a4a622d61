"""Attention kernels over each KV storage format.

    reference.py    pure-MLX attention: ``attend_full`` (one score matrix over the whole
                    context) and ``attend_blockwise`` (online softmax over blocks of T; the
                    reference every fused kernel is tested against)
    dispatch.py     ``attend``: the entry point the caches call; picks a verified fused
                    kernel, the full path or the blockwise reference by device and T
    cuda_attention.py  fused split-context attention on NVIDIA GPUs (``mx.fast.cuda_kernel``)
                    for L <= 16 over affine, mxfp4 and TurboQuant K/V; its device code is
                    cuda_source.py
    bench.py        ``kvserve bench-attention`` (measurements in bench_cases.py)

The caches' own full-context functions (``kvserve.cache.affine.attend_quantized``,
``kvserve.cache.turbo_codec.attend_encoded``) stay as the per-family oracles in tests.
"""
