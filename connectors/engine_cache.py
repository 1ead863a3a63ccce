"""One `LLM` per process for a given model and engine options, reused across connector calls.

The cache holds a single engine: on a GPU the KV cache takes most of the free memory, so a second model
could not be loaded beside the first. Asking for another model or other engine options drops the cached
engine before building the new one. Pass `llm=` to manage engines yourself.
"""

from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path
from typing import Any, Mapping

from batchllm.engine_client import EngineClient
from batchllm.entrypoints.llm import LLM

_lock = threading.Lock()
_cached: tuple[tuple, LLM] | None = None


def get_llm(model: str | Path | None = None, llm: EngineClient | None = None,
            engine_kwargs: Mapping[str, Any] | None = None) -> LLM:
    """`llm` itself when given; else the cached engine for (model, engine_kwargs), built on first use."""
    global _cached
    if llm is not None:
        if model is not None or engine_kwargs:
            raise ValueError("pass either llm= or model= / engine_kwargs=, not both")
        if not isinstance(llm, EngineClient):
            raise TypeError(f"llm must be a batchllm.LLM (or another batchllm.engine_client.EngineClient), "
                            f"got {type(llm).__name__}")
        return llm
    key = (None if model is None else str(Path(model).expanduser().resolve()),
           tuple(sorted((engine_kwargs or {}).items())))
    with _lock:
        if _cached is not None and _cached[0] == key:
            return _cached[1]
        clear_engine_cache()
        engine = LLM(model, **dict(engine_kwargs or {}))
        _cached = (key, engine)
        return engine


def clear_engine_cache() -> None:
    """Drop the cached engine so its weights and KV cache can be freed."""
    global _cached
    _cached = None
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the freed blocks back, so the next engine's memory profiling sees them
