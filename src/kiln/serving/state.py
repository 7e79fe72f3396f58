"""What every route shares: the predictor, the batcher, the limits, and the server's life cycle
(loading -> ready -> draining). Inference routes go through `admitted` and `infer`:

    async with state.admitted() as deadline:        # 503 while loading or draining
        body = await state.read_body(request, deadline)      # 413 past the limit, 504 too late
        inputs = await state.offload(size, parse, body)               # 4xx naming the field
        items = await state.convert(request, inputs, size, deadline)  # 4xx naming the item
        outputs = await state.infer(request, items, count, deadline)  # 503, 504, 499

Image files among the inputs are decoded in the decode pool (kiln.serving.decoding), always off
the event loop and under the request's deadline."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect, Request

from kiln.config.infer import ServerConfig
from kiln.inference import Predictor
from kiln.preprocessing import InputError
from kiln.preprocessing.image import ENCODED
from kiln.serving.batcher import DynamicBatcher
from kiln.serving.decoding import DecodePool
from kiln.serving.errors import (
    BadRequest,
    BatcherClosed,
    ClientGone,
    DeadlineExceeded,
    ModelFailed,
    PayloadTooLarge,
    RefusedFile,
    Unavailable,
)
from kiln.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)

OFFLOAD_BYTES = 256 * 1024  # bodies larger than this are parsed in a worker thread
DRAIN_RETRY_AFTER_S = 5.0  # what a client is told to wait while this server drains


class UnsupportedEncoding(BadRequest):
    status = 415


@dataclass
class ServingState:
    predictor: Predictor
    batcher: DynamicBatcher
    decoder: DecodePool
    metrics: ServingMetrics
    config: ServerConfig
    ready: bool = False
    draining: bool = False
    inflight: int = 0  # inference requests admitted and not yet answered
    # The tasks of admitted requests not yet in the batcher's queue: while there are some, a
    # batch waits for them (up to server.max_delay_ms); when there are none, it goes at once.
    arriving: set = field(default_factory=set)
    loop: asyncio.AbstractEventLoop | None = None  # the serving loop (signals hand work to it)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    _parser: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-parse")
    )

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @contextlib.asynccontextmanager
    async def admitted(self):
        """An inference request's admission; yields its deadline (time.monotonic())."""
        if self.draining:
            raise BatcherClosed(
                "the server is shutting down; retry on another", DRAIN_RETRY_AFTER_S
            )
        if not self.ready:
            raise Unavailable("the model is loading; retry shortly")
        self.inflight += 1
        self._idle.clear()
        task = asyncio.current_task()
        self.arriving.add(task)
        try:
            yield time.monotonic() + self.config.timeout_ms / 1000
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()
            self._queued(task)

    def _queued(self, task) -> None:
        """This request is no longer on its way to the queue (queued, refused or failed)."""
        if task in self.arriving:
            self.arriving.discard(task)
            self.batcher.wake()

    def begin_drain(self) -> None:
        """From now on readiness says 503 and new inference requests get 503; those admitted
        before carry on to their answers."""
        self.draining = True
        self.metrics.draining.set(1)

    async def idle(self) -> None:
        """Until no admitted request is left unanswered."""
        if self.inflight:
            await self._idle.wait()

    async def read_body(self, request: Request, deadline: float) -> bytes:
        """The body (see `read_body`), which must arrive before the request's deadline: a
        client trickling it in cannot hold a place, or a drain, for ever. A client that leaves
        before its body is all here is ClientGone (499), like one that leaves later."""
        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                return await read_body(request, self.config.max_body_bytes)
        except TimeoutError:
            raise DeadlineExceeded("the body did not arrive within server.timeout_ms") from None
        except ClientDisconnect:
            raise client_gone(request, "before sending its whole body") from None

    async def pace(self, err: Exception) -> None:
        """Before answering a refused image file: server.refusal_delay_ms. Called after the
        request's admission has ended, so a waiting refusal holds no slot and delays no drain."""
        if isinstance(err, RefusedFile) and self.config.refusal_delay_ms > 0:
            await asyncio.sleep(self.config.refusal_delay_ms / 1000)

    async def offload(self, size: int, fn, *args) -> Any:
        """fn(*args) here for small work, in the parsing thread for large bodies, so the event
        loop keeps answering other requests meanwhile."""
        if size < OFFLOAD_BYTES:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._parser, functools.partial(fn, *args))

    async def convert(
        self, request: Request | None, inputs: list, size: int, deadline: float
    ) -> Any:
        """Raw inputs -> the batcher's items (InputError naming the first bad one). Image files
        are decoded in the decode pool, whatever the body's size; the rest is converted (texts
        cleaned: at most server.max_text_chars each) here, or in the parsing thread for a large
        body. ClientGone if the client leaves meanwhile
        (its files not started are never decoded)."""
        if self.predictor.preprocess.input_kind == "tokens":
            check_text_lengths(inputs, self.config.max_text_chars)
        files = [(i, item) for i, item in enumerate(inputs) if isinstance(item, ENCODED)]
        if files:
            decoding = self.decoder.decode(files, deadline)
            decoded = await (decoding if request is None else self._watched(request, decoding))
            inputs = [decoded.get(i, item) for i, item in enumerate(inputs)]
            size = sum(image.nbytes for image in decoded.values())
        return await self.offload(size, self.predictor.convert, inputs)

    async def infer(self, request: Request, items: Any, count: int, deadline: float) -> Any:
        """The outputs for `items` from the batcher; ClientGone if the client leaves first (its
        inputs leave the queue)."""
        if count == 0:
            return self.predictor.empty_outputs()
        work = asyncio.ensure_future(self.batcher.submit(items, count, deadline))
        await asyncio.sleep(0)  # submit() queues the job before its first await
        self._queued(asyncio.current_task())
        return self._finite(await self._watched(request, work))

    async def _watched(self, request: Request, work) -> Any:
        """The result of `work`, or ClientGone (work cancelled) if the client leaves first."""
        work = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if work in done:
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise client_gone(request, "before its answer")

    def _finite(self, outputs: Any) -> Any:
        """JSON has no NaN or Inf, and a probability that is one is no answer: such outputs
        are the model failing on that input (500), never a number in the body."""
        index = self.predictor.first_nonfinite(outputs)
        if index is not None:
            log.error("the model's outputs for one input hold NaN or Inf")
            raise ModelFailed(
                f"the model's outputs for item {index} hold NaN or Inf (finite weights, valid "
                "input: a numerical overflow in the model)"
            )
        return outputs

    def close(self) -> None:
        self.decoder.stop()
        self._parser.shutdown(wait=False)


def check_text_lengths(inputs: list, limit: int) -> None:
    """InputError naming the first text (or either text of a pair) longer than `limit`
    characters: refused before any cleaning, tokenizing or batching."""
    for index, item in enumerate(inputs):
        texts = item if isinstance(item, list | tuple) else (item,)
        longest = max((len(text) for text in texts if isinstance(text, str | bytes)), default=0)
        if longest > limit:
            raise InputError(
                f"item {index}: a text of {longest:,} characters; server.max_text_chars is "
                f"{limit:,} (the model reads only its first tokens: send the start of it)",
                index,
            )


def client_gone(request: Request, when: str) -> ClientGone:
    """ClientGone (counted as 499; nothing can be sent), and its one log line: a client that
    hangs up is not a server error, and must not flood the log."""
    client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
    message = f"the client closed the connection {when}"
    log.warning("499 %s %s from %s: %s", request.method, request.url.path, client, message)
    return ClientGone(message)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes: at once from its
    Content-Length, or while it streams in; then inflated if gzip/deflate-encoded (the inflated
    size is held to the same limit)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(
            f"the body is {declared} bytes; server.max_body_bytes is {limit}",
            {"Connection": "close"},
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(
                f"the body passed server.max_body_bytes={limit}", {"Connection": "close"}
            )
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise UnsupportedEncoding(
            f"Content-Encoding {encoding!r} is not supported; send identity, gzip or deflate"
        )
    return _inflate(body, encoding, limit)


def _inflate(body: bytes, encoding: str, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as err:
        raise BadRequest(f"the body is not valid {encoding} data ({err})") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise PayloadTooLarge(
            f"the {encoding} body inflates past server.max_body_bytes={limit}",
            {"Connection": "close"},
        )
    return out
