"""KV transfer: moving paged KV-cache blocks from a prefill engine to a decode engine."""
