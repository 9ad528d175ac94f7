"""Structured outputs: constraints (JSON schemas, regexes, choices, grammars, structural tags)
compiled to llguidance grammars, and the per-request matchers whose token masks the sampler
applies. Torch-free, so the API process can validate constraints at the edge."""

from baton.engine.structured.backend import Grammar, GrammarCompiler, GrammarError

__all__ = ["Grammar", "GrammarCompiler", "GrammarError"]
