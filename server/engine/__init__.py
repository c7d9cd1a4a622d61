"""The engine thread: scheduling policy, the model runner, sampling, the serving model."""
