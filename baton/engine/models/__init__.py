"""Model definitions, weight loading and the tiny-model writer."""
