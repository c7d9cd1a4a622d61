"""The server: ``http`` (OpenAI API) in front of ``engine`` (the thread that runs the model)."""
