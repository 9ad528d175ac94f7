"""Paged KV cache: block pool and cache manager."""
