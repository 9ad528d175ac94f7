"""One engine: scheduler, KV cache manager, model runner and the offline `LLM` API."""
