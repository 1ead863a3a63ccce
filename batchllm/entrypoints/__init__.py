"""The doors to the engine: the `LLM` facade (llm.py, engine_stream.py, pooling.py, beam_search.py), the table
doors' `generate` / `embed` (api.py), the command line (cli/), the OpenAI-compatible server (server/). Each builds an
`EngineConfig` from its options and uses the engine through `EngineClient` (batchllm/engine_client.py). Ray's
predictor is `batchllm.ray`, a public module at the package root."""
