"""Model runner, attention and sampling: the worker side of the engine."""
