"""Continuous-batching scheduler and its contract with the worker."""
