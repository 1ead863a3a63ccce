"""`batchllm serve`: an OpenAI-compatible HTTP server on one engine (needs the `serve` extra: fastapi, uvicorn,
prometheus-client).

- `engine_loop.EngineLoop` runs the engine in one background thread and admits requests between steps;
- `app.build_app` is the FastAPI application (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
  `/health`, `/metrics`);
- `cli` is the `batchllm serve` command.

Nothing here is imported by `import batchllm`; fastapi and uvicorn are imported only by `app` and `cli`.
"""
