"""The model's building blocks that know the paged KV cache: attention and its backends."""
