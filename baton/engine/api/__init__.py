"""The OpenAI-compatible engine server: request/response models, the FastAPI app, metrics."""
