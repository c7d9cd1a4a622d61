"""Load benchmarks against any OpenAI-compatible server (``kvserve bench``).

``load`` drives C concurrent streams and measures each request; ``targets`` starts the
servers to compare (kvserve and ``mlx_lm.server`` on the same model directory, the same
BLAS and the same weights) one after another; ``report`` writes the Markdown table and
the PNG chart. ``speed.py`` and ``kv_bytes.py`` are standalone scripts.
"""
