"""The OpenAI-compatible HTTP server (`kvmemo serve`): FastAPI app over an AsyncEngine."""
