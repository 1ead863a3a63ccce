"""How `batchllm serve` ends: a uvicorn server whose first SIGTERM / SIGINT drains the engines and whose second stops
everything at once.

First signal: new requests get 503 (and /health 503) while the requests in flight get up to `grace_seconds`; at the
deadline every engine is stopped (`EngineHandle.stop`: its requests are aborted at the next step boundary, and an
engine process whose step overruns is terminated, then killed), so the streams still open end with finish_reason
"abort", and the server closes. Second signal: the engine processes are killed and this process exits at once with
status 128 + the signal's number. Nothing prints a traceback on either path: the HTTP server runs in the main thread,
which is never inside an engine step, so a signal's handler runs as soon as it arrives.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any


def drain(engines: list[Any], grace_seconds: float) -> None:
    """Stop admitting on every engine, give the requests in flight up to `grace_seconds` in all, then stop them."""
    for engine in engines:
        engine.stop_admitting()
    deadline = time.monotonic() + grace_seconds
    for engine in engines:
        engine.wait_idle(max(0.0, deadline - time.monotonic()))
    stoppers = [threading.Thread(target=engine.stop, name="batchllm-stop") for engine in engines]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join()


def draining_server(uvicorn: Any, config: Any, engines: list[Any], grace_seconds: float) -> Any:
    """A uvicorn.Server with the signal handling above (uvicorn's own would close the listening socket at once, and
    raise the signal again after it stops)."""

    class DrainingServer(uvicorn.Server):
        _drain: threading.Thread | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self._drain is not None:  # a second signal: stop now
                print("batchllm: stopping at once", file=sys.stderr, flush=True)
                for engine in engines:
                    kill = getattr(engine, "kill", None)
                    if kill is not None:
                        kill()
                os._exit(128 + sig)
            print(f"batchllm: draining: no new requests; the ones in flight get up to {grace_seconds:g} s "
                  f"(signal again to stop at once)", file=sys.stderr, flush=True)
            self._drain = threading.Thread(target=self._drain_then_exit, name="batchllm-drain", daemon=True)
            self._drain.start()

        def _drain_then_exit(self) -> None:
            drain(engines, grace_seconds)
            self.should_exit = True

    return DrainingServer(config)
