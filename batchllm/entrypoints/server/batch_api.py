"""OpenAI's Files and Batch APIs on the server's engine: `mount_batch_api(app, loop, data_dir, auth)`.

    POST   /v1/files                 multipart `file` + `purpose` ("batch"); 413 past the upload limit
    GET    /v1/files                 newest first (`purpose`, `limit`, `after`, `order`)
    GET    /v1/files/{id}            the file object;   GET /v1/files/{id}/content: its bytes
    DELETE /v1/files/{id}            409 while an unfinished batch reads it
    POST   /v1/batches               `input_file_id`, `endpoint`, `completion_window` "24h", `metadata`
                                     (endpoint: /v1/completions or /v1/chat/completions; /v1/embeddings on an
                                     embed server, `--task embed`, which serves only that one)
    GET    /v1/batches               newest first (`limit`, `after`)
    GET    /v1/batches/{id}          POST /v1/batches/{id}/cancel

One server per data dir (`DATA_DIR/lock`). Errors are OpenAI's JSON (`errors.APIError`): unknown ids 404, bad
parameters 400 naming the field, a cancel of a batch that already ended 409. Storage is under `data_dir`
(`files.py`, `batches.py`); the batches run one at a time on a background thread (`batch_runner.py`); the ones a
previous server left unfinished resume at once. Batches do not expire here: `expires_at` is informative and
`output_expires_after` is accepted and ignored.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException

from batchllm.connectors.jobs.openai_batch import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL
from batchllm.entrypoints.server.batch_runner import BatchRunner, BatchSettings
from batchllm.entrypoints.server.batches import (
    CANCELLABLE,
    COMPLETION_WINDOW_SECONDS,
    BatchRecord,
    BatchStore,
    new_batch_id,
)
from batchllm.entrypoints.server.errors import APIError, bad_request
from batchllm.entrypoints.server.files import INPUT_PURPOSE, FileStore, FileTooLarge
from batchllm.entrypoints.server.served_models import ServedModels

_GENERATE_ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
_BATCH_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"})
_MULTIPART_SLACK = 1 << 20  # headers and boundaries around the file in an upload's body


@dataclass(slots=True)
class BatchService:
    files: FileStore
    batches: BatchStore
    runner: BatchRunner
    data_dir_lock: int  # the fd holding DATA_DIR/lock

    def close(self) -> None:
        """Stop the batch worker (the app's shutdown does): the running batch resumes on the next start."""
        if self.data_dir_lock < 0:
            return
        self.runner.close()
        os.close(self.data_dir_lock)
        self.data_dir_lock = -1


def _lock_data_dir(data_dir: Path) -> int:
    """An exclusive flock on DATA_DIR/lock: two servers on one data dir would run each other's batches. The kernel
    drops it when the process dies, even on SIGKILL, so a restart never finds it stale."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RuntimeError(f"the data dir {data_dir} is in use by another batchllm server (pid {holder}); give "
                           f"each server its own --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def mount_batch_api(app: FastAPI, engines: Any, data_dir: Path, auth_dependency: Callable | None = None,
                    settings: BatchSettings | None = None) -> BatchService:
    """Add the Files and Batch routes to `app`, with `auth_dependency` on each; the batches run on the engines
    (one `EngineHandle`, or the `ServedModels`) through their `batch_engine()`. Starts the batch worker, which first
    resumes unfinished batches."""
    models = engines if isinstance(engines, ServedModels) else ServedModels.single(engines)
    settings = settings or BatchSettings()
    data_dir = Path(data_dir).expanduser()
    lock = _lock_data_dir(data_dir)
    files, batches = FileStore(data_dir / "files"), BatchStore(data_dir / "batches")
    runner = BatchRunner(batches, files, models, settings)
    service = BatchService(files, batches, runner, lock)
    router = APIRouter(prefix="/v1", dependencies=[Depends(auth_dependency)] if auth_dependency else [])
    _file_routes(router, service, settings.max_upload_bytes)
    _batch_routes(router, service, settings, models.default.task == "embed")
    app.include_router(router)
    if APIError not in app.exception_handlers:  # an app that build_app did not make
        async def api_error(request: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status_code)

        app.add_exception_handler(APIError, api_error)
    app.router.on_shutdown.append(service.close)
    service.runner.start()
    return service


def _found(record: Any, kind: str, object_id: str, param: str = "id") -> Any:
    """`record`, or OpenAI's 404 for the `kind` object `object_id` that no store holds."""
    if record is None:
        raise APIError(404, f"No such {kind} object: {object_id}", param=param)
    return record


def _file_routes(router: APIRouter, service: BatchService, max_bytes: int) -> None:
    files = service.files

    def existing(file_id: str):
        return _found(files.get(file_id), "File", file_id)

    @router.post("/files")
    async def upload(request: Request):
        if int(request.headers.get("content-length") or 0) > max_bytes + _MULTIPART_SLACK:
            raise APIError(413, f"the file is larger than the server's limit of {max_bytes} bytes", param="file")
        try:
            form = await request.form(max_files=1, max_fields=8)
        except MultiPartException as exc:
            raise bad_request(f"the body is not a valid multipart form: {exc.message}") from None
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(purpose, str) or not purpose:
                raise bad_request("Missing required parameter: 'purpose'", "purpose")
            if purpose != INPUT_PURPOSE:
                raise bad_request(f"Invalid value for purpose: {purpose!r}; this server accepts only "
                                  f"{INPUT_PURPOSE!r}", "purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("Missing required parameter: 'file' (a file part of the multipart form)", "file")
            try:
                record = await run_in_threadpool(files.upload, upload.file, upload.filename or "upload.jsonl",
                                                 purpose, max_bytes)
            except FileTooLarge as exc:
                raise APIError(413, str(exc), param="file") from None
        finally:
            await form.close()
        return record.to_openai()

    @router.get("/files")
    def list_files(request: Request):
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"Invalid value for order: {order!r} (asc or desc)", "order")
        records = files.list(query.get("purpose"))
        if order == "asc":
            records.reverse()
        return _page(records, _limit(query, 10000, 10000), query.get("after"), lambda r: r.to_openai())

    @router.get("/files/{file_id}")
    def get_file(file_id: str):
        return existing(file_id).to_openai()

    @router.get("/files/{file_id}/content")
    def file_content(file_id: str):
        record = existing(file_id)
        return FileResponse(files.content_path(file_id), media_type="application/octet-stream",
                            filename=record.filename)

    @router.delete("/files/{file_id}")
    def delete_file(file_id: str):
        existing(file_id)
        readers = service.batches.references(file_id)
        if readers:
            raise APIError(409, f"file {file_id} is the input of batch {readers[0]}, which has not ended", param="id")
        files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def _batch_routes(router: APIRouter, service: BatchService, settings: BatchSettings, embeds: bool) -> None:
    batches, runner = service.batches, service.runner

    def shown(record: BatchRecord) -> dict[str, Any]:
        return record.to_openai(runner.progress(record))

    def existing(batch_id: str) -> BatchRecord:
        return _found(batches.get(batch_id), "Batch", batch_id)

    @router.post("/batches")
    async def create_batch(request: Request):
        body = await _json_object(request)
        input_file_id, endpoint, metadata = _batch_fields(body, embeds)
        file = _found(service.files.get(input_file_id), "File", input_file_id, "input_file_id")
        if file.purpose != INPUT_PURPOSE:
            raise bad_request(f"file {input_file_id} has purpose {file.purpose!r}; a batch's input needs "
                              f"{INPUT_PURPOSE!r}", "input_file_id")
        now = int(time.time())
        record = await run_in_threadpool(batches.add, BatchRecord(
            new_batch_id(), endpoint, input_file_id, "24h", now, settings.rows_per_shard, metadata,
            expires_at=now + COMPLETION_WINDOW_SECONDS))
        runner.submit(record.id)
        return shown(record)

    @router.get("/batches")
    def list_batches(request: Request):
        query = request.query_params
        return _page(batches.list(), _limit(query, 20, 100), query.get("after"), shown)

    @router.get("/batches/{batch_id}")
    def get_batch(batch_id: str):
        return shown(existing(batch_id))

    @router.post("/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str):
        record = existing(batch_id)
        if record.status == "cancelling":
            return shown(record)
        cancelled = batches.update(batch_id, only_from=CANCELLABLE, status="cancelling")
        if cancelled is None:
            raise APIError(409, f"Cannot cancel a batch with status '{batches.get(batch_id).status}'.")
        runner.cancel(batch_id)
        return shown(cancelled)


def _batch_fields(body: dict[str, Any], embeds: bool) -> tuple[str, str, dict[str, str] | None]:
    unknown = sorted(set(body) - _BATCH_FIELDS)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for name in ("input_file_id", "endpoint", "completion_window"):
        if body.get(name) is None:
            raise bad_request(f"Missing required parameter: '{name}'", name)
    input_file_id, endpoint = body["input_file_id"], body["endpoint"]
    if not isinstance(input_file_id, str) or not input_file_id:
        raise bad_request("Invalid value for input_file_id: expected a file id string", "input_file_id")
    endpoints = (EMBEDDINGS_URL,) if embeds else _GENERATE_ENDPOINTS
    if endpoint not in endpoints:
        why = ""
        if embeds:
            why = " (this server embeds: --task embed)"
        elif endpoint == EMBEDDINGS_URL:
            why = " (this server was started without --task embed)"
        raise bad_request(f"Invalid value for endpoint: {endpoint!r}{why}; supported: {', '.join(endpoints)}",
                          "endpoint")
    if body["completion_window"] != "24h":
        raise bad_request(f"Invalid value for completion_window: {body['completion_window']!r}; supported: '24h'",
                          "completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())):
        raise bad_request("Invalid value for metadata: at most 16 string pairs, keys up to 64 characters and "
                          "values up to 512", "metadata")
    return input_file_id, endpoint, metadata


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("We could not parse the JSON body of your request: it is not valid JSON.") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got a JSON {type(body).__name__}.")
    return body


def _limit(query: Any, default: int, most: int) -> int:
    text = query.get("limit")
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise bad_request(f"Invalid value for limit: {text!r} (an integer from 1 to {most})", "limit")
    return int(text)


def _page(records: list[Any], limit: int, after: str | None, show: Callable[[Any], dict]) -> dict[str, Any]:
    """OpenAI's cursor page over `records` (already in page order): the ones after the id `after`."""
    if after is not None:
        ids = [r.id for r in records]
        if after not in ids:
            raise bad_request(f"Invalid value for after: no object with id {after!r}", "after")
        records = records[ids.index(after) + 1:]
    data = [show(r) for r in records[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(records) > limit}
