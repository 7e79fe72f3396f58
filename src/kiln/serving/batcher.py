"""Dynamic batching: requests wait in a queue until `max_batch_size` inputs have gathered or the
oldest has waited `max_delay_ms`; then one batched predict runs in a worker thread (so the event
loop keeps accepting requests) and each request gets back exactly its own slice.

A failing model call fails only the requests in that batch, with the error; nothing queued is
dropped silently -- on shutdown whatever is still waiting is failed with BatcherClosed."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kiln.serving.metrics import ServingMetrics


class BatcherClosed(RuntimeError):
    """The server is shutting down (or not started); the request was not run."""


class QueueFull(RuntimeError):
    """Too many requests are waiting; the client should retry later."""


class BatchFailed(RuntimeError):
    """The model call for this request's batch raised."""


@dataclass
class _Request:
    inputs: Sequence[Any]
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.perf_counter)


class DynamicBatcher:
    def __init__(
        self,
        predict_fn: Callable[[list[Any]], list[Any]],
        *,
        max_batch_size: int,
        max_delay_ms: float,
        max_queue_size: int,
        metrics: ServingMetrics,
    ):
        self.predict_fn = predict_fn  # one output per input, in order
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_ms / 1000
        self.max_queue_size = max_queue_size
        self.metrics = metrics
        self._waiting: collections.deque[_Request] = collections.deque()
        self._arrived = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        # One worker thread: model calls never overlap, so batching (not threads) gives throughput.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-predict")
        self._loop_task = asyncio.create_task(self._batch_loop(), name="kiln-batcher")

    async def submit(self, inputs: Sequence[Any]) -> list[Any]:
        """Predictions for `inputs`, computed in some batch together with other requests."""
        if self._loop_task is None or self._loop_task.done():
            raise BatcherClosed("the model is not running (server starting up or shutting down)")
        if len(self._waiting) >= self.max_queue_size:
            raise QueueFull(f"{len(self._waiting)} requests already waiting; retry later")
        request = _Request(inputs, asyncio.get_running_loop().create_future())
        self._waiting.append(request)
        self.metrics.queue_depth.set(len(self._waiting))
        self._arrived.set()
        return await request.future

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        while self._waiting:
            _fail(self._waiting.popleft(), BatcherClosed("the server shut down before running it"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # -----------------------------------------------------------------------------------------

    def _num_waiting_inputs(self) -> int:
        return sum(len(r.inputs) for r in self._waiting)

    async def _gather(self) -> None:
        """Return once the queue is non-empty and either full enough or old enough."""
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        deadline = self._waiting[0].enqueued_at + self.max_delay_s
        while self._num_waiting_inputs() < self.max_batch_size:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()
            except TimeoutError:
                return

    def _take_batch(self) -> list[_Request]:
        """Whole requests, oldest first, up to max_batch_size inputs (always at least one
        request; one larger than max_batch_size is split into model calls by _run)."""
        batch = [self._waiting.popleft()]
        count = len(batch[0].inputs)
        while self._waiting and count + len(self._waiting[0].inputs) <= self.max_batch_size:
            count += len(self._waiting[0].inputs)
            batch.append(self._waiting.popleft())
        self.metrics.queue_depth.set(len(self._waiting))
        return batch

    async def _batch_loop(self) -> None:
        while True:
            await self._gather()
            batch = self._take_batch()
            try:
                await self._run(batch)
            except asyncio.CancelledError:
                for request in batch:
                    _fail(request, BatcherClosed("the server shut down while running it"))
                raise

    async def _run(self, batch: list[_Request]) -> None:
        started = time.perf_counter()
        for request in batch:
            self.metrics.queue_wait.observe(started - request.enqueued_at)
        inputs = [x for request in batch for x in request.inputs]
        try:
            outputs = await self._predict_in_chunks(inputs)
        except Exception as err:  # fail this batch's requests, keep serving the next ones
            self.metrics.failed_batches.inc()
            for request in batch:
                _fail(request, BatchFailed(f"prediction failed: {type(err).__name__}: {err}"))
            return
        start = 0
        for request in batch:
            end = start + len(request.inputs)
            if not request.future.done():  # a client that went away cancelled its future
                request.future.set_result(outputs[start:end])
            start = end

    async def _predict_in_chunks(self, inputs: list[Any]) -> list[Any]:
        loop = asyncio.get_running_loop()
        outputs: list[Any] = []
        for start in range(0, len(inputs), self.max_batch_size):
            chunk = inputs[start : start + self.max_batch_size]
            self.metrics.batch_size.observe(len(chunk))
            with self.metrics.inference.time():
                outputs += await loop.run_in_executor(self._executor, self.predict_fn, chunk)
        if len(outputs) != len(inputs):
            raise AssertionError(f"predict returned {len(outputs)} outputs for {len(inputs)}")
        return outputs


def _fail(request: _Request, error: Exception) -> None:
    if not request.future.done():
        request.future.set_exception(error)
