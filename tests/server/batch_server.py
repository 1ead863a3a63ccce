"""A server process for the Batch API's kill-and-restart test: the real app and engine loop, with small batch shards
and frequent checkpoints so that a batch is visibly half done for a while.

    python tests/server/batch_server.py DATA_DIR MODEL_DIR

It listens on 127.0.0.1 on a port the OS picks and writes that port to DATA_DIR/port once it serves.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import uvicorn

from batchllm import LLM
from batchllm.entrypoints.server.app import build_app
from batchllm.entrypoints.server.batch_runner import BatchSettings
from batchllm.entrypoints.server.engine_loop import EngineLoop

SETTINGS = BatchSettings(rows_per_shard=4, flush_seconds=0.2, max_in_flight=2)


def main(data_dir: Path, model: Path) -> None:
    loop = EngineLoop(LLM(model, max_num_seqs=4, num_kv_blocks=128))
    app = build_app(loop, data_dir=data_dir, batch_settings=SETTINGS)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    (data_dir / "port.tmp").write_text(str(port))
    (data_dir / "port.tmp").replace(data_dir / "port")
    thread.join()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
