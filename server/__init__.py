"""The server: ``http`` (OpenAI API) in front of ``engine`` (the thread that runs the model),
which gets its model from ``models`` (loading, GGUF conversion, weight formats)."""
