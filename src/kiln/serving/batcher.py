"""Dynamic batching that holds under load and bad input.

Requests arrive already validated and converted, one `Job` each (its items: an array of raw
pixels, a list of texts or of images). When the model is free the loop takes what is queued at
once -- unless requests the server has already admitted are still on their way to the queue
(their bodies being read or parsed: `more_coming`), for which it waits until `max_batch_size`
inputs are queued or the oldest has waited `max_delay_ms`. So a lone request never waits out the
window, and a burst still rides in one model call. It then fills one batch fairly: every
waiting job gets a share before any job gets more, and a job with inputs left goes to the back
of the queue. So a request of 20,000 inputs is split across many model calls and a small
request that arrives meanwhile rides in the next one. The model runs in one worker thread; the
event loop keeps serving.

Failures stay with their request. If a batched call raises, the batch is split in halves and
each half retried, down to single inputs: only the request whose input fails gets the error
(its InputError, or ModelFailed), everyone else their answer. The loop itself never stops: an
error in it is logged and counted, and the next batch runs.

Limits: a job that would take the queue past `max_queue_size` inputs is refused at once
(QueueFull: 503 with Retry-After). A job past its deadline, or whose client went away, leaves
the queue: its inputs not yet run are never run. On shutdown, `close` refuses new jobs and
`cut` answers the waiting ones with BatcherClosed (503), never leaving one unanswered."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kiln.preprocessing import InputError
from kiln.serving.errors import (
    BatcherClosed,
    ClientGone,
    DeadlineExceeded,
    ModelFailed,
    QueueFull,
    ServingError,
)
from kiln.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)

SECONDS_PER_INPUT_PRIOR = 1e-3  # the Retry-After estimate before the first batch is timed
EMA_WEIGHT = 0.2  # how fast the per-input time estimate follows new batches
SECONDS_PER_CALL_PRIOR = 1.0  # before the first call is timed: as if slow (the thread)
# A model call shorter than this runs on the event loop (it blocks other requests for at most
# about this long: the batch loop yields after each batch): for a tiny model the thread
# hand-off was most of a request's time.
INLINE_CALL_S = 0.0005


@dataclass(eq=False)
class Job:
    """One request's inputs on their way through the batches."""

    items: Any  # validated inputs: sliceable (an array or a list), len(items) == count
    count: int
    deadline: float  # time.monotonic() by which the answer must be ready
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.monotonic)
    taken: int = 0  # inputs already handed to a batch (items[:taken])
    pieces: dict[int, Any] = field(default_factory=dict)  # start index -> outputs of that slice
    done: int = 0  # inputs answered

    @property
    def finished(self) -> bool:
        return self.future.done()

    def fail(self, error: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass
class Slice:
    """items[start:stop] of one job, inside a batch."""

    job: Job
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class DynamicBatcher:
    def __init__(
        self,
        run: Callable[[Any], Any],
        join: Callable[[list[Any]], Any],
        *,
        max_batch_size: int,
        max_delay_ms: float,
        max_queue_size: int,
        metrics: ServingMetrics,
        more_coming: Callable[[], bool] = lambda: True,
    ):
        self.run = run  # validated items -> outputs, one per item, in order
        self.join = join  # [items or outputs of several slices] -> one
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_ms / 1000
        self.max_queue_size = max_queue_size  # inputs, all waiting jobs together
        self.metrics = metrics
        self.more_coming = more_coming  # admitted requests not yet queued? (default: assume so)
        self.seconds_per_input = SECONDS_PER_INPUT_PRIOR
        self.seconds_per_call = SECONDS_PER_CALL_PRIOR  # in the thread until measured faster
        self._queue: collections.deque[Job] = collections.deque()
        self._queued_inputs = 0  # inputs of queued jobs not yet taken into a batch
        self._arrived = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._loop_task: asyncio.Task | None = None
        self._open = False

    # --- life cycle --------------------------------------------------------------------------

    async def start(self) -> None:
        # One worker thread: model calls never overlap, so batching (not threads) gives throughput.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-predict")
        self._loop_task = asyncio.create_task(self._batch_loop(), name="kiln-batcher")
        self._open = True

    def close(self) -> None:
        """Refuse new jobs (503); queued and running ones carry on."""
        self._open = False

    def cut(self, reason: str) -> int:
        """Answer every queued job not yet finished with BatcherClosed (503); returns how many.
        Inputs already in a running model call finish, and their jobs keep those answers only
        if every input of theirs is done."""
        cut = 0
        while self._queue:
            job = self._queue.popleft()
            if not job.finished:
                job.fail(BatcherClosed(reason, self.retry_after_s()))
                cut += 1
        self._queued_inputs = 0
        self._update_depth()
        return cut

    async def stop(self) -> None:
        self.close()
        self.cut("the server shut down before running it")
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # --- submitting --------------------------------------------------------------------------

    def retry_after_s(self) -> float:
        """How long the inputs queued now take to run, by the recent per-input time."""
        return self._queued_inputs * self.seconds_per_input

    async def submit(self, items: Any, count: int, deadline: float) -> Any:
        """The outputs for `items` (count inputs), computed in batches with other requests.
        Raises QueueFull / BatcherClosed (503), DeadlineExceeded (504), InputError or
        ModelFailed (this request's inputs failed on their own)."""
        if not self._open or self._loop_task is None or self._loop_task.done():
            raise BatcherClosed("the model is not taking requests (starting up or shutting down)")
        if self._queued_inputs + count > self.max_queue_size:
            raise QueueFull(
                f"{self._queued_inputs} inputs already waiting (server.max_queue_size="
                f"{self.max_queue_size}); retry later",
                self.retry_after_s(),
            )
        job = Job(items, count, deadline, asyncio.get_running_loop().create_future())
        self._queue.append(job)
        self._queued_inputs += count
        self._update_depth()
        self._arrived.set()
        try:
            done, _ = await asyncio.wait({job.future}, timeout=deadline - time.monotonic())
        except asyncio.CancelledError:  # the handler was cancelled: the client went away
            self._abandon(job, ClientGone("the client closed the connection"))
            self.metrics.abandoned.inc()
            raise
        if not done:
            self._abandon(job, DeadlineExceeded("deadline exceeded"))
            self.metrics.deadline_exceeded.inc()
            raise DeadlineExceeded(
                f"no answer within the request's deadline ({count} inputs; "
                f"{job.done} were done, {job.count - job.taken} never ran)"
            )
        return job.future.result()

    def _abandon(self, job: Job, error: ServingError) -> None:
        """Out of the queue: its inputs not yet taken are never run."""
        if job in self._queue:
            self._queue.remove(job)
            self._queued_inputs -= job.count - job.taken
            self._update_depth()
        job.fail(error)
        if not job.future.cancelled() and job.future.done():
            job.future.exception()  # retrieved: no "exception was never retrieved" warning

    def _update_depth(self) -> None:
        self.metrics.queue_depth.set(self._queued_inputs)
        self.metrics.queued_requests.set(len(self._queue))

    # --- the loop ----------------------------------------------------------------------------

    async def _batch_loop(self) -> None:
        while True:
            try:
                await self._gather()
                batch = self._take_batch()
                if batch:
                    await self._run_batch(batch)
                # With a full queue and inline calls nothing above awaits: without this the
                # loop would run every queued batch before a health check or a new request.
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop serving: log it, run the next batch
                log.exception("error in the batching loop; it carries on")
                self.metrics.loop_errors.inc()
                await asyncio.sleep(0)

    def wake(self) -> None:
        """Something the gathering waits on changed (e.g. an admitted request will not come)."""
        self._arrived.set()

    async def _gather(self) -> None:
        """Return once the queue holds a full batch, or nothing more is on its way, or its
        oldest job has waited long enough."""
        while not self._queue:
            self._arrived.clear()
            await self._arrived.wait()
        deadline = self._queue[0].enqueued_at + self.max_delay_s
        while self._queued_inputs < self.max_batch_size and self.more_coming():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._queue:
                return
            self._arrived.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()
            except TimeoutError:
                return

    def _candidates(self) -> list[Job]:
        """The oldest live jobs, at most max_batch_size of them (popped from the queue). Jobs
        past their deadline leave here if their waiter has not removed them yet."""
        now = time.monotonic()
        jobs: list[Job] = []
        while self._queue and len(jobs) < self.max_batch_size:
            job = self._queue.popleft()
            if job.finished or job.deadline <= now:
                self._queued_inputs -= job.count - job.taken
                if not job.finished:
                    self.metrics.deadline_exceeded.inc()
                    job.fail(DeadlineExceeded("deadline exceeded while queued"))
                continue
            jobs.append(job)
        return jobs

    def _take_batch(self) -> list[Slice]:
        """Up to max_batch_size inputs, shared fairly: first each waiting job (oldest first)
        gets an equal share, then leftover room goes oldest first. A job with inputs left moves
        behind all the others (round robin), so no request waits behind a large one."""
        jobs = self._candidates()
        room = self.max_batch_size
        share = max(1, room // max(len(jobs), 1))
        taking = [0] * len(jobs)
        for i, job in enumerate(jobs):  # pass 1: an equal share each
            taking[i] = min(share, job.count - job.taken, room)
            room -= taking[i]
        for i, job in enumerate(jobs):  # pass 2: what is left, oldest first
            extra = min(room, job.count - job.taken - taking[i])
            taking[i] += extra
            room -= extra
        batch, untouched, moved = [], [], []
        for job, n in zip(jobs, taking, strict=True):
            if n:
                batch.append(Slice(job, job.taken, job.taken + n))
                job.taken += n
                self._queued_inputs -= n
            if job.taken < job.count:
                (moved if n else untouched).append(job)
        self._queue.extendleft(reversed(untouched))
        self._queue.extend(moved)
        self._update_depth()
        return batch

    async def _run_batch(self, batch: list[Slice]) -> None:
        started = time.monotonic()
        for piece in batch:
            if piece.start == 0:
                self.metrics.queue_wait.observe(started - piece.job.enqueued_at)
        try:
            await self._run_isolated(batch)
        except asyncio.CancelledError:  # stop(): no request is left without an answer
            for piece in batch:
                piece.job.fail(BatcherClosed("the server shut down while running it"))
            raise

    async def _call(self, slices: list[Slice]) -> Any:
        """One model call over these slices' items: in the worker thread, or -- for a model
        whose calls take less than INLINE_CALL_S -- right here, where handing the call to the
        thread and its answer back (two thread wake-ups, each waiting for a core on a busy
        machine) cost more than the call itself."""
        items = self.join([piece.job.items[piece.start : piece.stop] for piece in slices])
        count = sum(piece.size for piece in slices)
        self.metrics.batch_size.observe(count)
        started = time.perf_counter()
        try:
            with self.metrics.inference.time():
                if self.seconds_per_call < INLINE_CALL_S:
                    return self.run(items)
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._executor, self.run, items)
        finally:
            seconds = time.perf_counter() - started
            self.seconds_per_input += EMA_WEIGHT * (seconds / count - self.seconds_per_input)
            self.seconds_per_call += EMA_WEIGHT * (seconds - self.seconds_per_call)

    async def _run_isolated(self, slices: list[Slice]) -> None:
        """Run these slices together; if the call raises, split in halves and retry each, so
        only the input that fails on its own takes its request down."""
        slices = [piece for piece in slices if not piece.job.finished]
        count = sum(piece.size for piece in slices)
        if count == 0:
            return
        try:
            outputs = await self._call(slices)
            if len(outputs) != count:
                raise AssertionError(f"the model returned {len(outputs)} outputs for {count}")
        except Exception as err:  # a model error fails its batch's requests, not the server
            self.metrics.failed_batches.inc()
            if count == 1:
                self._fail_alone(slices[0], err)
                return
            self.metrics.batch_splits.inc()
            first, second = _split(slices, count // 2)
            await self._run_isolated(first)
            await self._run_isolated(second)
            return
        offset = 0
        for piece in slices:
            self._deliver(piece, outputs[offset : offset + piece.size])
            offset += piece.size

    def _fail_alone(self, piece: Slice, err: Exception) -> None:
        index = piece.start  # the input's position in its own request
        if isinstance(err, InputError):
            piece.job.fail(InputError(f"item {index}: the model refused it: {err}", index))
            return
        log.error("the model failed on one input alone: %s: %s", type(err).__name__, err)
        piece.job.fail(
            ModelFailed(
                f"the model failed on item {index} of this request (the other requests in its "
                f"batch were answered): {type(err).__name__}: {err}"
            )
        )

    def _deliver(self, piece: Slice, outputs: Any) -> None:
        job = piece.job
        if job.finished:  # failed, timed out or abandoned meanwhile: the outputs are dropped
            return
        job.pieces[piece.start] = outputs
        job.done += piece.size
        if job.done == job.count:
            job.future.set_result(self.join([job.pieces[k] for k in sorted(job.pieces)]))


def _split(slices: list[Slice], at: int) -> tuple[list[Slice], list[Slice]]:
    """Slices covering inputs [0, at) and [at, n) of the concatenation."""
    first: list[Slice] = []
    second: list[Slice] = []
    seen = 0
    for piece in slices:
        if seen + piece.size <= at:
            first.append(piece)
        elif seen >= at:
            second.append(piece)
        else:
            cut = piece.start + (at - seen)
            first.append(Slice(piece.job, piece.start, cut))
            second.append(Slice(piece.job, cut, piece.stop))
        seen += piece.size
    return first, second
