"""The engine thread: scheduling policy, the model runner, sampling, model loading."""
