"""FastAPI app, OpenAI schemas, errors and streaming; never imports mlx."""
