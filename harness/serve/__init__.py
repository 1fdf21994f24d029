"""`zoo serve`: an OpenAI-compatible HTTP server over the engine (needs the `serve` extra: fastapi, uvicorn)."""
