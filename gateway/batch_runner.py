"""Runs the batches: each from `validating` through `in_progress` and `finalizing` to `completed`
(or `failed`, `expired`, `cancelling` -> `cancelled`), OpenAI's lifecycle, with live counts.

A line counts as done only once its output is in the store's results log. A batch runs under a
lease from the store, renewed every third of it: every batch that has not ended and that no one
holds (at start, or when the gateway that ran it died) is claimed and resumes, skipping the lines its
log holds, so none is lost and none answered twice. At most `batch_concurrency` lines of all batches
are in the engine at once; each is ballast there (actors/scheduler/ballast.py), so interactive
requests never wait behind them.
"""
from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from gateway import batch_lines, expiry
from gateway.batch_lines import Line
from gateway.batch_store import BatchStore, LeaseLost, new_id, now
from gateway.state import GatewayState
from gateway.tenant import current_api_key
from runtime import get_logger

log = get_logger(component="batch")
ENDED = ("completed", "failed", "expired", "cancelled")


@dataclass
class _Job:
    record: dict                       # {"batch": the batch object, "owner": ...}
    lease: str                         # the store's lease on it, while this gateway runs it
    run: asyncio.Task | None = None
    tasks: set[asyncio.Task] = field(default_factory=set)   # its lines in the engine now

    @property
    def batch(self) -> dict:
        return self.record["batch"]


class BatchRunner:
    def __init__(self, state: GatewayState, store: BatchStore) -> None:
        self.state = state
        self.store = store
        self.config = state.config
        self._slots = asyncio.Semaphore(self.config.batch_concurrency)
        self._jobs: dict[str, _Job] = {}
        self._runs: set[asyncio.Task] = set()
        self._upkeep: asyncio.Task | None = None

    def open(self) -> None:
        """At start: batches resume, and from then on leases are renewed and orphans taken over."""
        self._upkeep = asyncio.create_task(self._look_after(), name="batch-upkeep")

    async def start(self, record: dict) -> None:
        """Runs a new batch here, unless another gateway claimed it first."""
        lease = await self.store.claim(record["batch"]["id"])
        if lease is not None:
            self._start(record, lease)

    def _start(self, record: dict, lease: str) -> None:
        job = _Job(record, lease)
        self._jobs[job.batch["id"]] = job
        job.run = asyncio.create_task(self._run(job), name=f"batch-{job.batch['id']}")
        self._runs.add(job.run)
        job.run.add_done_callback(self._runs.discard)

    async def stop(self) -> None:
        """At shutdown: lines in the engine are aborted, unrecorded; they run again after a restart,
        or at once on another gateway (the leases are given back)."""
        if self._upkeep is not None:
            self._upkeep.cancel()
            await asyncio.gather(self._upkeep, return_exceptions=True)
        for task in self._runs:
            task.cancel()
        await asyncio.gather(*self._runs, return_exceptions=True)

    async def view(self, batch_id: str) -> dict | None:
        """The batch as it is now: a running one's live counts, else as stored (with the counts its
        results log holds, and a cancel asked of another gateway, while it runs there)."""
        job = self._jobs.get(batch_id)
        if job is not None:
            return job.record
        record = await self.store.load_batch(batch_id)
        if record is not None and self._past_retention(record):
            await self._forget(record)
            return None
        if record is None or record["batch"]["status"] in ENDED:
            return record
        batch = record["batch"]
        counts = batch["request_counts"]
        counts["completed"], counts["failed"] = await self.store.results(batch_id).counts()
        if batch["status"] in ("validating", "in_progress"):
            asked = await self.store.cancel_requested(batch_id)
            if asked is not None:
                batch["status"], batch["cancelling_at"] = "cancelling", asked
        return record

    async def cancel(self, batch_id: str) -> dict | None:
        """The batch, cancelling; None when it can no longer be cancelled."""
        job = self._jobs.get(batch_id)
        if job is not None:
            if job.batch["status"] in ("validating", "in_progress"):
                await self._set_status(job, "cancelling")
                for task in job.tasks:
                    task.cancel()
            return job.record
        record = await self.view(batch_id)
        if record is None or record["batch"]["status"] in ENDED:
            return None
        if record["batch"]["status"] != "cancelling":
            await self.store.request_cancel(batch_id)   # the gateway running it sees this and obeys
            record = await self.view(batch_id)
        return record

    # --- leases -------------------------------------------------------------------------------------

    async def _look_after(self) -> None:
        while True:
            try:
                await self._renew()
                await self._take_over()
                await self._sweep_files()
            except asyncio.CancelledError:
                raise
            except Exception:   # the store unreachable for a while: the next round tries again
                log.exception("batch upkeep failed")
            await asyncio.sleep(self.store.lease_s / 3)

    async def _renew(self) -> None:
        for batch_id, job in list(self._jobs.items()):
            if not await self.store.renew(batch_id, job.lease):
                log.warning("batch lease lost: another gateway runs it now", batch_id=batch_id)
                job.run.cancel()
            elif job.batch["status"] in ("validating", "in_progress") and \
                    await self.store.cancel_requested(batch_id) is not None:
                await self.cancel(batch_id)

    async def _take_over(self) -> None:
        """Claims every batch that has not ended and that no gateway holds (the record is read again
        once claimed, as its last holder may have moved it on meanwhile); forgets those ended longer
        than --batch-retention ago."""
        for batch_id in await self.store.batch_ids():
            if batch_id in self._jobs:
                continue
            record = await self.store.load_batch(batch_id)
            if record is not None and self._past_retention(record):
                await self._forget(record)
            if record is None or record["batch"]["status"] in ENDED:
                continue
            lease = await self.store.claim(batch_id)
            if lease is None:
                continue
            record = await self.store.load_batch(batch_id)
            if record is None or record["batch"]["status"] in ENDED:
                await self.store.release(batch_id, lease)
                continue
            log.info("batch resumed", batch_id=batch_id, status=record["batch"]["status"])
            self._start(record, lease)

    async def _sweep_files(self) -> None:
        """Expired files go (in Redis they expire by themselves; a directory keeps them until now)."""
        for file_id in await self.store.file_ids():
            obj = await self.store.load_file(file_id)
            if obj is not None and obj["expires_at"] is not None and obj["expires_at"] <= now():
                await self.store.delete_file(file_id)

    def _past_retention(self, record: dict) -> bool:
        return record["batch"]["status"] in ENDED and \
            expiry.past_retention(record["batch"], self.config.batch_retention_s, now())

    async def _forget(self, record: dict) -> None:
        batch = record["batch"]
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            if file_id is not None:
                await self.store.delete_file(file_id)
        await self.store.delete_batch(batch["id"])
        log.info("batch deleted after its retention", batch_id=batch["id"])

    # --- one batch ----------------------------------------------------------------------------------

    async def _run(self, job: _Job) -> None:
        # Its lines are salted as its owner's requests, also after a restart (see gateway/tenant.py).
        current_api_key.set(f"batch:{job.record['owner']}" if job.record["owner"] else None)
        try:
            lines = await self._lines(job)
            if lines is None:
                return
            if job.batch["status"] == "validating":
                job.batch["in_progress_at"] = now()
                await self._set_status(job, "in_progress")
            results = self.store.results(job.batch["id"])
            done = await self._count(job, results)
            pending = deque(line for line in lines if line.index not in done)
            if job.batch["status"] == "in_progress" and pending:
                await self._run_lines(job, pending, results)
            await self._finish(job, lines, results)
        except asyncio.CancelledError:
            raise
        except LeaseLost:
            log.warning("batch left to the gateway that holds it now", batch_id=job.batch["id"])
        except Exception as e:   # a fault of ours: the batch fails, the gateway goes on
            log.exception("batch failed", batch_id=job.batch["id"])
            try:
                await self._fail(job, "internal_error", f"The batch failed: {e}")
            except Exception:
                log.exception("batch failure not recorded", batch_id=job.batch["id"])
        finally:
            self._jobs.pop(job.batch["id"], None)
            try:   # another gateway may take it at once (a shutdown), or it has ended
                await asyncio.shield(self.store.release(job.batch["id"], job.lease))
            except Exception:
                log.warning("batch lease not released; it lapses by itself", batch_id=job.batch["id"])

    async def _run_lines(self, job: _Job, pending: deque[Line], results) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(min(self.config.batch_concurrency, len(pending))):
                    tg.create_task(self._worker(job, pending, results))
        except* LeaseLost as group:
            raise group.exceptions[0] from None

    async def _lines(self, job: _Job) -> list[Line] | None:
        """The input file's lines; None (the batch failed) when there is no usable file."""
        batch = job.batch
        if await self.store.load_file(batch["input_file_id"]) is None:
            await self._fail(job, "invalid_file", f"The input file {batch['input_file_id']} no longer exists.")
            return None
        data = await self.store.read_data(batch["input_file_id"])
        lines = await asyncio.to_thread(batch_lines.parse_lines, data, batch["endpoint"],
                                        self.config.max_body_bytes)
        limit = self.config.batch_max_lines
        if not lines:
            await self._fail(job, "empty_file", "The input file holds no request lines.")
        elif len(lines) > limit:
            await self._fail(job, "too_many_lines", f"The input file has {len(lines)} lines; a batch may have at "
                                                    f"most {limit} (--batch-max-lines).")
        else:
            batch["request_counts"]["total"] = len(lines)
            return lines
        return None

    async def _count(self, job: _Job, results) -> set[int]:
        """The lines its results log holds, counted into the batch."""
        done, counts = set(), job.batch["request_counts"]
        counts["completed"] = counts["failed"] = 0
        for record in await results.records():
            done.add(record["index"])
            counts["completed" if record["ok"] else "failed"] += 1
        return done

    async def _worker(self, job: _Job, pending: deque[Line], results) -> None:
        while pending and job.batch["status"] == "in_progress" and now() < job.batch["expires_at"]:
            async with self._slots:
                if not pending or job.batch["status"] != "in_progress":
                    return
                line = pending.popleft()
                task = asyncio.create_task(batch_lines.answer(self.state, job.batch["endpoint"], line))
                job.tasks.add(task)
                try:
                    ok, out = await task
                except asyncio.CancelledError:
                    if job.batch["status"] == "cancelling" and not _cancelling_me():
                        return   # the batch was cancelled: the line is dropped unanswered
                    raise
                finally:
                    job.tasks.discard(task)
                if await results.append({"index": line.index, "ok": ok, "line": out}, job.lease):
                    job.batch["request_counts"]["completed" if ok else "failed"] += 1
                    self.state.metrics.batch_line(ok)

    async def _finish(self, job: _Job, lines: list[Line], results) -> None:
        """The output and error files of what finished; lines an expired batch never ran go to the
        error file as `batch_expired`."""
        batch = job.batch
        status = "cancelled" if batch["status"] == "cancelling" else batch["status"]
        if status in ("in_progress", "finalizing"):
            counts = batch["request_counts"]
            status = "completed" if counts["completed"] + counts["failed"] == counts["total"] else "expired"
        batch["finalizing_at"] = batch["finalizing_at"] or now()
        await self._set_status(job, "finalizing" if status in ("completed", "expired") else batch["status"])
        records = sorted(await results.records(), key=lambda r: r["index"])
        outputs = [r["line"] for r in records if r["ok"]]
        errors = [r["line"] for r in records if not r["ok"]]
        if status == "expired":
            finished = {r["index"] for r in records}
            errors += [batch_lines.not_run(line, "batch_expired", "The batch expired before this line ran.")
                       for line in lines if line.index not in finished]
        batch["output_file_id"] = await self._output_file(job, outputs, "output")
        batch["error_file_id"] = await self._output_file(job, errors, "error")
        batch[f"{status}_at"] = now()
        await self._set_status(job, status)
        self.state.metrics.batch_ended(status)
        log.info("batch ended", batch_id=batch["id"], status=status, **batch["request_counts"])

    async def _output_file(self, job: _Job, lines: list[dict], kind: str) -> str | None:
        if not lines:
            return None
        data = b"".join(msgspec.json.encode(line) + b"\n" for line in lines)
        return await save_file(self.store, self.config, data, f"{job.batch['id']}_{kind}.jsonl", "batch_output",
                               job.record["owner"], job.record.get("output_ttl_s"))

    async def _fail(self, job: _Job, code: str, message: str) -> None:
        job.batch["errors"] = {"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                           "line": None}]}
        job.batch["failed_at"] = now()
        await self._set_status(job, "failed")
        self.state.metrics.batch_ended("failed")
        log.warning("batch failed", batch_id=job.batch["id"], code=code, error=message)

    async def _set_status(self, job: _Job, status: str) -> None:
        job.batch["status"] = status
        if status == "cancelling":
            job.batch["cancelling_at"] = now()
        await self.store.save_batch(job.record, job.lease)


BATCHES = web.AppKey("batches", BatchRunner)   # the app's Files and Batches store and runner


def _cancelling_me() -> bool:
    """This worker itself is being cancelled (shutdown), not only the line it awaited."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def save_file(store: BatchStore, config, data: bytes, filename: str, purpose: str, owner: str,
                    ttl_s: int | None = None) -> str:
    """A new file in the store, kept `ttl_s` (else --batch-file-ttl); its id."""
    file_id = new_id("file-")
    await store.write_data(file_id, data)
    created = now()
    await store.save_file({"id": file_id, "object": "file", "bytes": len(data), "created_at": created,
                     "filename": filename, "purpose": purpose, "status": "processed",
                     "expires_at": created + int(ttl_s or config.batch_file_ttl_s), "status_details": None,
                     "owner": owner})
    return file_id


def owner_of(api_key: str) -> str:
    """Whose files and batches these are: a digest of the API key ('' without one), never the key."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32] if api_key else ""
