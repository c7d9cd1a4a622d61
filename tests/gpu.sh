#!/usr/bin/env bash
# The tests that exercise a CUDA GPU, in one command, on a machine where MLX's CUDA backend is
# installed and `kvserve` imports (docs/benchmarks/gpu-status.md says how to set one up):
#   - the fused CUDA and tensor-core attention kernels against their reference, and the dense
#     path (decode, then MLX's SDPA) that serves prompt chunks over stored codes;
#   - the default model served over HTTP on the GPU: greedy answers alone and in a batch of 8,
#     streaming, and prefix cache files reused by a restarted server;
#   - the HTTP layer on a tiny model (errors, streaming, logprobs, metrics, restarts);
#   - speculative decoding over HTTP: prompt lookup on the default model, a draft model on a
#     tiny one;
#   - the device profile and the warm-up: a burst of requests after start-up compiles no kernel.
# Without a GPU the kernel files skip and the rest runs on the CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c 'import mlx.core as mx; print("MLX", mx.__version__, "default device:", mx.default_device(),
"| CUDA:", mx.cuda.is_available())'
# Four workers where pytest-xdist is installed: one after another the files take over 10 minutes
# on an H100, most of it starting servers and compiling kernels.
workers=(); python3 -c 'import xdist' 2>/dev/null && workers=(-n 4)
# One compiled-kernel folder for every server of the run (each test gives its server a fresh
# --cache-dir, where each would compile the same kernels again: 100-230 s per start on an H100).
# test_warmup.py points its servers at folders of their own, to count what they compile, and
# comes first: its two cold warm-ups (minutes each) start while the other files run.
export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-$(mktemp -d)}"
exec python3 -m pytest -q -p no:cacheprovider "${workers[@]}" tests/test_warmup.py tests/test_kernels_cuda.py \
    tests/test_kernels_mma.py tests/test_kernels.py::test_dense_path_equals_the_reference_for_prompt_chunks \
    tests/test_real_model.py tests/test_http.py tests/test_speculative_http.py -k "not gemma3" "$@"
