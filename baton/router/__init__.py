"""The router: the cluster-wide OpenAI endpoint in front of prefill, decode and aggregated engines.

Never imports torch or engine internals.
"""
