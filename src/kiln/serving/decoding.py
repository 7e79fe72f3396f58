"""Image files decoded off the event loop, in a bounded pool of threads shared fairly by requests.

Every file a request sends (base64 in v1, BYTES in v2) is decoded here, whatever the size of the
body: never on the event loop, so /healthz, /readyz and every other request keep their answers
while a large photo decodes. The header is read first: a file whose pixels (width x height, x a
GIF's frames) pass server.max_image_pixels is refused without being decoded -- a decompression
bomb costs the microseconds of reading its header.

Threads, not processes, because the decoders let go of the GIL while they decode: a thread
decoding 3000x3000 JPEGs or PNGs in a loop leaves Python on another thread running at the same
speed (1.0x, with one intra-op thread as the server runs; scripts/measure_decode_gil.py), and
the event loop wakes as soon as before. What decoders and the loop compete for is the CPU, which
processes would not give back -- at the price of a torch import in each and a copy of every
decoded image.

A request's files are one `DecodeJob`. They wait here, not in an executor's queue: each time a
thread is free, the loop hands it the next file of the waiting job with the fewest files in a
thread now (the oldest of those), so a request of many large photos holds at most the threads
nobody else is waiting for, and a one-photo request arriving behind it gets the next free
thread, not the turn after all of that request's photos. Large images (over LARGE_IMAGE_PIXELS
by their header, e.g. a 12 MP phone photo) decode on at most threads - 1 threads at once: a
thread that finds one with no room left for large files hands it back to wait for a large
slot, so however many large images arrive, small ones always find a thread. A job ends
at its first bad file (InputError naming the item; its other files are not decoded), at its
deadline (DeadlineExceeded: files not started never start), or when its client leaves. A file
already in a thread finishes there -- a decoder cannot be stopped midway; the pixel limit bounds
how long it takes -- and its result is dropped. More files waiting than `max_queued`: 503 with
Retry-After at once (DecodeQueueFull)."""

from __future__ import annotations

import asyncio
import collections
import functools
import io
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kiln.preprocessing.errors import InputError
from kiln.serving.errors import (
    BatcherClosed,
    ClientGone,
    DeadlineExceeded,
    DecodeQueueFull,
    RefusedFile,
)
from kiln.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)

# An image of more pixels than this (2048 x 2048; decoding takes ~50 ms and up) is large: at
# most threads - 1 threads decode large images at once.
LARGE_IMAGE_PIXELS = 2048 * 2048
SECONDS_PER_FILE_PRIOR = 0.01  # the Retry-After estimate before the first file is timed
EMA_WEIGHT = 0.2  # how fast the per-file time estimate follows new files
WARMUP_SIZE = (40, 48)  # (H, W) of the warm-up images: not square, so the resize really runs
# Formats left out of the warm-up: ICNS because Pillow writes every icon size up to 1024 px
# (0.6 s and 2 MB here; its images are PNGs, which the warm-up decodes anyway).
WARMUP_SKIPPED = frozenset({"ICNS"})


@dataclass(eq=False)
class DecodeJob:
    """One request's image files on their way through the decode threads."""

    files: collections.deque  # (index in the request, the file's bytes), not started yet
    count: int
    deadline: float  # time.monotonic() by which every file must be decoded
    future: asyncio.Future  # -> {index: decoded image}
    # Large files a thread handed back (no large slot was free), waiting for one.
    large: collections.deque = field(default_factory=collections.deque)
    decoded: dict[int, Any] = field(default_factory=dict)
    running: int = 0  # its files in a thread now

    @property
    def finished(self) -> bool:
        return self.future.done()

    @property
    def waiting(self) -> int:
        return len(self.files) + len(self.large)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)
            self.future.exception()  # retrieved: its waiter may be gone already


class DecodePool:
    def __init__(
        self,
        decode: Callable[[bytes, int], Any],
        *,
        pixels: Callable[[bytes], int],
        max_pixels: int,
        threads: int,
        max_queued: int,
        metrics: ServingMetrics,
    ):
        self.decode_one = decode  # (file bytes, index in its request) -> image; InputError
        self.pixels = pixels  # file bytes -> the pixels its header claims (0: unknown)
        self.max_pixels = max_pixels  # above it, `decode` refuses the file at once
        self.threads = threads
        self.large_threads = max(1, threads - 1)
        self.max_queued = max_queued  # files waiting for a thread, all requests together
        self.metrics = metrics
        self.seconds_per_file = SECONDS_PER_FILE_PRIOR
        self._jobs: collections.deque[DecodeJob] = collections.deque()
        self._queued = 0  # files of waiting jobs not yet in a thread
        self._running = 0  # files in a thread now (also those whose job has ended)
        self._large_running = 0  # large files decoding now (threads claim a slot: the lock)
        self._large_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    # --- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="kiln-decode")

    def stop(self) -> None:
        """Answer every waiting job with BatcherClosed (503); files in a thread finish there."""
        executor, self._executor = self._executor, None
        closed = BatcherClosed("the server shut down before decoding it")
        while self._jobs:
            self._drop(self._jobs[0], closed)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    # --- decoding ----------------------------------------------------------------------------

    def retry_after_s(self) -> float:
        """How long the files waiting and running now take, by the recent per-file time."""
        return (self._queued + self._running) * self.seconds_per_file / self.threads

    async def decode(self, files: list[tuple[int, bytes]], deadline: float) -> dict[int, Any]:
        """{index: decoded image} for these (index, file bytes). Raises the first bad file's
        InputError, DecodeQueueFull / BatcherClosed (503) or DeadlineExceeded (504)."""
        if self._executor is None:
            raise BatcherClosed("the server is not decoding images (starting up or shutting down)")
        if self._queued + len(files) > self.max_queued:
            raise DecodeQueueFull(
                f"{self._queued} image files already waiting to be decoded "
                f"(server.max_decode_queue_size={self.max_queued}); retry later",
                self.retry_after_s(),
            )
        future = asyncio.get_running_loop().create_future()
        job = DecodeJob(collections.deque(files), len(files), deadline, future)
        self._jobs.append(job)
        self._queued += job.count
        self._dispatch()
        try:
            done, _ = await asyncio.wait({job.future}, timeout=deadline - time.monotonic())
        except asyncio.CancelledError:  # the handler was cancelled: the client went away
            self._drop(job, ClientGone("the client closed the connection"))
            raise
        if not done:
            never = job.waiting
            self._drop(job, DeadlineExceeded("deadline exceeded while decoding"))
            self.metrics.deadline_exceeded.inc()
            raise DeadlineExceeded(
                f"the image files were not decoded within the request's deadline "
                f"({len(job.decoded)} of {job.count} decoded, {never} never started)"
            )
        return job.future.result()

    def _dispatch(self) -> None:
        """Hand each free thread a file: first a large one handed back, if a large slot is
        free; else the next file of the waiting job with the fewest files in a thread (the
        oldest such job). Jobs past their deadline start nothing more (their waiters take
        them out)."""
        now = time.monotonic()
        while self._running < self.threads and self._executor is not None:
            live = [job for job in self._jobs if job.deadline > now]
            large = [job for job in live if job.large]
            if large and self._large_running < self.large_threads:
                job = min(large, key=lambda job: job.running)  # the first of the least served
                self._start(job, *job.large.popleft(), known_large=True)
                continue
            fresh = [job for job in live if job.files]
            if not fresh:
                break
            job = min(fresh, key=lambda job: job.running)
            self._start(job, *job.files.popleft(), known_large=False)
        self._update_gauges()

    def _start(self, job: DecodeJob, index: int, data: bytes, known_large: bool) -> None:
        self._queued -= 1
        if not job.waiting:
            self._jobs.remove(job)
        job.running += 1
        self._running += 1
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(self._executor, self._timed, data, index, known_large)
        running.add_done_callback(functools.partial(self._finished, job, index, data))

    def _timed(self, data: bytes, index: int, known_large: bool) -> tuple:
        """In a decode thread: (image, None, seconds), (None, the error, seconds), or
        (HANDED_BACK, None, 0) for a large file while every large slot is taken."""
        started = time.perf_counter()
        large = known_large or LARGE_IMAGE_PIXELS < self.pixels(data) <= self.max_pixels
        if large:
            with self._large_lock:
                if self._large_running >= self.large_threads:
                    return HANDED_BACK, None, 0.0
                self._large_running += 1
        try:
            return self.decode_one(data, index), None, time.perf_counter() - started
        except Exception as err:  # a user's bad item: its own error answer
            return None, err, time.perf_counter() - started
        finally:
            if large:
                with self._large_lock:
                    self._large_running -= 1

    def _finished(self, job: DecodeJob, index: int, data: bytes, running: asyncio.Future) -> None:
        """On the loop, when a thread is done with one file."""
        self._running -= 1
        job.running -= 1
        if running.cancelled():  # the pool shut down before the thread took it
            job.fail(BatcherClosed("the server shut down before decoding it"))
        else:
            image, error, seconds = running.result()
            if image is HANDED_BACK:
                self._wait_for_large_slot(job, index, data)
            else:
                self._record(job, index, image, error, seconds)
        self._dispatch()

    def _wait_for_large_slot(self, job: DecodeJob, index: int, data: bytes) -> None:
        if job.finished:
            return
        job.large.append((index, data))
        self._queued += 1
        if job not in self._jobs:
            self._jobs.append(job)

    def _record(self, job: DecodeJob, index: int, image, error, seconds: float) -> None:
        self.seconds_per_file += EMA_WEIGHT * (seconds - self.seconds_per_file)
        self.metrics.decode_seconds.observe(seconds)
        if error is not None:
            self.metrics.bad_image_files.inc()
            if isinstance(error, InputError):
                error = RefusedFile(str(error), error.index)
            self._drop(job, error)  # the first bad file ends its request
        elif not job.finished:
            job.decoded[index] = image
            if len(job.decoded) == job.count:
                job.future.set_result(job.decoded)

    def _drop(self, job: DecodeJob, error: BaseException) -> None:
        """The job leaves the queue: its files not started never start."""
        if job in self._jobs:
            self._jobs.remove(job)
        self._queued -= job.waiting
        job.files.clear()
        job.large.clear()
        job.fail(error)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.decode_queue_depth.set(self._queued)
        self.metrics.decoding.set(self._running)


HANDED_BACK = object()  # what a thread returns for a large file while no large slot is free


def header_pixels(data: bytes) -> int:
    """The pixels an encoded image's header claims (frames x canvas); 0 when it has no readable
    header (decoding it then says why)."""
    from kiln.preprocessing.image_files import ImageDecodeError, read_image_header

    try:
        return read_image_header(data).pixels
    except ImageDecodeError:
        return 0


@functools.cache
def warmup_files() -> dict[str, bytes]:
    """A small real image in every format Pillow can write and read ({format: file bytes}): the
    warm-up decodes each before the server says ready, so no decoder is first set up by a
    user's request. Formats Pillow cannot write here (no encoder, an RGB it refuses) or read
    back (EPS without Ghostscript) are not in it."""
    import numpy as np
    from PIL import Image

    Image.init()
    height, width = WARMUP_SIZE
    across = np.broadcast_to(np.linspace(0, 255, width), (height, width))
    down = np.broadcast_to(np.linspace(255, 0, height)[:, None], (height, width))
    pixels = np.stack([across, down, np.full((height, width), 128.0)], axis=-1)
    image = Image.fromarray(pixels.astype(np.uint8))  # RGB gradients
    files = {}
    for fmt in sorted(set(Image.SAVE) & set(Image.OPEN) - WARMUP_SKIPPED):
        buffer = io.BytesIO()
        try:
            image.save(buffer, fmt)
            with Image.open(io.BytesIO(buffer.getvalue())) as written:
                written.load()
        except (OSError, ValueError, KeyError):
            continue
        files[fmt] = buffer.getvalue()
    return files
