#!/usr/bin/env bash
# The CPU kernels (kernels/cpu_*.cpp) under AddressSanitizer: pytest with the extensions built
# with -fsanitize=address (their own build key, so the usual builds stay) and MLX's buffer
# cache off, so every buffer a kernel reads or writes is one malloc block with red zones
# around it. A read or write outside one stops that process and leaves a report naming the
# kernel's line (docs/testing.md, sixteenth round).
#
#   bash tests/asan.sh [PYTEST ARGS]    default: the test files that run the kernels
#
# Reports go to $ASAN_DIR (default /tmp/kvserve-asan, emptied first) as log.<pid>; the
# script prints them and exits 1 when there is one. Tests of malloc itself (test_memory.py)
# fail under the sanitizer's malloc and are not in the default list.
set -uo pipefail
cd "$(dirname "$0")/.."
report=${ASAN_DIR:-/tmp/kvserve-asan}
rm -rf "$report" && mkdir -p "$report"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
cat > "$site/sitecustomize.py" <<'EOF'
from kvserve.server.models.blas import enable_fast_blas

enable_fast_blas()  # before mlx is imported, as every kvserve process does

import mlx.core as mx  # noqa: E402

import kvserve.kernels.cpu_build as build  # noqa: E402

build._FLAGS = ("-O3", "-g", "-std=c++20", "-fsanitize=address", "-fno-omit-frame-pointer")
mx.set_cache_limit(0)  # a freed buffer goes back to malloc, not to the next array
EOF
# libstdc++ with the sanitizer: it finds the C++ exception functions it wraps at start-up.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
export ASAN_OPTIONS="detect_leaks=0:log_path=$report/log"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
if [ $# -eq 0 ]; then
    set -- -n 2 --dist loadfile tests/test_cpu_ops.py tests/test_cpu_attention.py tests/test_kernels.py \
        tests/test_turbo.py tests/test_cache_laws.py tests/test_layer_kinds.py tests/test_batching.py \
        tests/test_kv_memory.py tests/test_container.py tests/test_packed.py tests/test_eval_kv.py \
        tests/test_prefix_engine.py tests/test_prefix_checkpoints.py tests/test_architectures.py \
        tests/test_speculative.py tests/test_sampling.py tests/test_projections.py
fi
.venv/bin/python -m pytest -p no:cacheprovider "$@"
status=$?
unset LD_PRELOAD
if compgen -G "$report/log.*" > /dev/null; then
    for log in "$report"/log.*; do echo "== $log"; grep -A12 -m1 "ERROR: AddressSanitizer" "$log" || head -20 "$log"; done
    exit 1
fi
echo "no AddressSanitizer report (pytest exit $status)"
exit $status
