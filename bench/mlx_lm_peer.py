"""``mlx_lm.server`` as the benchmark's peer, on the same footing as kvserve.

    python -m kvserve.bench.mlx_lm_peer --model DIR --port 8080 [--kv-bits 4 ...]

Before mlx is imported, the same BLAS as ``kvserve serve`` is enabled (same environment
settings); after mlx-lm loads the model, the weight format kvserve would measure and pick
is applied. Everything else is stock ``mlx_lm.server``: its scheduler, its caches, its
HTTP handling.
"""

from __future__ import annotations

import sys

from kvserve.server.models.blas import enable_fast_blas


def main() -> None:
    info = enable_fast_blas()
    import mlx_lm.server as server

    from kvserve.server.models.weights import apply_weight_format, choose_weight_format

    stock_load = server.load

    def load(*args, **kwargs):
        loaded = stock_load(*args, **kwargs)
        choice = choose_weight_format(loaded[0], "auto")
        apply_weight_format(loaded[0], choice)
        print(f"peer: {info.describe()}; weights {choice.describe()}", file=sys.stderr, flush=True)
        return loaded

    server.load = load
    server.main()


if __name__ == "__main__":
    main()
