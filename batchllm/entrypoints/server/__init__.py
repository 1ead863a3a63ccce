"""`batchllm serve`: an OpenAI-compatible HTTP server (needs the `serve` extra: fastapi, uvicorn, prometheus-client).

- `engine_handle.EngineHandle` is the HTTP side's view of an engine; `engine_process.EngineProcess` runs one in a
  process of its own (what `batchllm serve` does, one per served model), `engine_loop.EngineLoop` in a thread of
  this process; both admit requests between steps (`engine_driver.py`);
- `app.build_app` is the FastAPI application (`/v1/completions`, `/v1/chat/completions`, `/v1/embeddings`,
  `/v1/models`, the Batch API, `/health`, `/metrics`), over one engine or several (`served_models.py`);
- `cli` is the `batchllm serve` command.

Nothing here is imported by `import batchllm`; fastapi and uvicorn are imported only by `app` and `cli`.
"""
