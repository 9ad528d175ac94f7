"""Structured outputs end to end through the in-process engine."""
