"""The attention backends' names, torch-free, for configs and flags to check against."""

ATTENTION_BACKENDS = ("torch", "triton")  # see `layers.attention.make_attention_backend`
