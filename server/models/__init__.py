"""Model loading: from what ``--model`` names to an mlx-lm model ready to run.

    registry.py        models that ship on PyPI, by short name ("default", "gemma3-270m")
    source.py          ``--model`` -> an mlx-lm model directory (fetching, converting once)
    gguf.py            GGUF header reader and the conversion into an mlx-lm directory
    gguf_arch.py       per-architecture tensor names and config.json (llama, gemma3)
    gguf_tensors.py    ggml tensor types (legacy and K-quants) -> MLX affine or dense arrays
    gguf_tokenizer.py  tokenizer.json from the GGUF vocabulary (byte-level BPE, SentencePiece)
    weights.py         the weight representation measured fastest at start-up
    blas.py            OpenBLAS for MLX's CPU matmuls, set up before mlx is imported
    load.py            all of the above in order: model, tokenizer, config and ``ModelInfo``

Nothing here imports the engine, the HTTP layer or the KV caches: they build on this.
"""
