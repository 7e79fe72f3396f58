"""Run the app under uvicorn (`python infer.py mode=serve ...`), with a drain on SIGTERM/SIGINT:

1. at once: readiness (/readyz, /v2/health/ready) answers 503 and new inference requests get
   503 with Retry-After, while the listener stays open so clients see an answer, not a refusal;
2. every request admitted before is answered -- within server.drain_grace_s, which start-up
   checks is longer than server.timeout_ms, so at worst they get their 504 in time; should the
   grace still run out, the queue is cut with 503s (never 500s);
3. then the listener closes (new connections are refused), and the server waits for its
   kept-alive connections to close -- every answer says Connection: close once draining, so
   each closes after its next answer, or at uvicorn's keep-alive timeout -- so a request a
   client has just sent on one is answered, never reset;
4. and the process exits with status 0.

A second signal stops waiting: the queue is cut at once."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import select
import signal
import socket
import struct
import sys
import time

import uvicorn

from kiln.config.infer import ServerConfig
from kiln.inference import Predictor
from kiln.serving.app import create_app
from kiln.serving.protocol import guarded_protocol
from kiln.serving.state import ServingState

log = logging.getLogger(__name__)

# Python hands the GIL to a waiting thread only every switch interval (5 ms by default): the
# model thread, waiting for it between torch ops while the event loop parses requests, would
# spend most of a small model call waiting. 0.5 ms keeps the model thread fed.
GIL_SWITCH_INTERVAL_S = 0.0005
AFTER_CUT_WAIT_S = 30.0  # after cutting the queue: time for the model call in progress
GRACEFUL_SHUTDOWN_S = 5.0  # uvicorn's own wait for connections, once nothing is in flight
CONNECTION_WAIT_MARGIN_S = 0.5  # past uvicorn's keep-alive timeout, for its timer to fire
CONNECTION_POLL_S = 0.02
ACCEPT_QUEUE_WAIT_S = 0.5  # at most, for the event loop to accept what the kernel queued
BPF_RET_K = 0x06  # BPF_RET | BPF_K: return a constant (0: drop the packet)
SO_ATTACH_FILTER = 26  # Linux's <asm-generic/socket.h>; Python's socket module lacks it


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServingState):
        super().__init__(config)
        self.state = state
        self.drain_task: asyncio.Task | None = None
        self.cut_now = False  # a second signal: stop waiting

    def handle_exit(self, sig: int, frame) -> None:
        """Called on SIGTERM/SIGINT, in the main thread. Unlike uvicorn's, it does not re-raise
        the signal after shutdown: a drained server exits with status 0."""
        loop = self.state.loop
        if loop is None:  # not started yet: nothing admitted, nothing to drain
            self.should_exit = True
            return
        if self.state.draining:
            log.warning("second signal %s: cutting the queue now", signal.Signals(sig).name)
            self.cut_now = True
            loop.call_soon_threadsafe(self.cut, "the server was stopped before running it")
            return
        log.info("signal %s: draining (readiness is 503 from now)", signal.Signals(sig).name)
        self.state.begin_drain()
        loop.call_soon_threadsafe(self.start_drain)

    def start_drain(self) -> None:
        self.drain_task = asyncio.ensure_future(self.drain())

    def cut(self, reason: str) -> None:
        self.state.batcher.close()
        count = self.state.batcher.cut(reason)
        log.warning("answered %d queued requests with 503: %s", count, reason)

    async def drain(self) -> None:
        grace = self.state.config.drain_grace_s
        try:
            await asyncio.wait_for(self.state.idle(), grace)
        except TimeoutError:
            self.cut(
                f"the server is shutting down and its grace period (server.drain_grace_s="
                f"{grace:g}) ended before this request ran"
            )
            try:
                await asyncio.wait_for(self.state.idle(), AFTER_CUT_WAIT_S)
            except TimeoutError:
                log.error("requests still unanswered %.0f s after the cut", AFTER_CUT_WAIT_S)
        log.info("drained: every admitted request answered; closing connections")
        await self.connections_closed()
        self.should_exit = True

    async def connections_closed(self) -> None:
        """Stop listening (a client now sees a refusal), then wait until every connection is
        closed (or a second signal, or the keep-alive timeout). Once draining each answer says
        Connection: close, so a connection closes after its next answer; one idle since before
        the drain may carry a request at any moment until uvicorn's keep-alive timeout closes
        it -- closing it now would reset that request (the client's ReadError)."""
        await refuse_then_close(self.servers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_keep_alive + CONNECTION_WAIT_MARGIN_S
        while self.server_state.connections and not self.cut_now and loop.time() < deadline:
            await asyncio.sleep(CONNECTION_POLL_S)


async def refuse_then_close(listeners) -> None:
    """Close the listening sockets without resetting a connection the kernel has already
    accepted for us: closing a listener resets every connection still in its accept queue,
    after the client may have sent its request (httpx.ReadError). So new connection attempts
    are dropped first (a socket filter; the client's connect then fails), the queue is
    accepted -- and answered, 503 with Connection: close -- and only then the sockets close."""
    sockets = [sock for listener in listeners for sock in listener.sockets]
    filtered = all(_drop_new_connections(sock) for sock in sockets)
    if filtered:
        deadline = time.monotonic() + ACCEPT_QUEUE_WAIT_S
        while time.monotonic() < deadline and _pending(sockets):
            await asyncio.sleep(0.005)
    for listener in listeners:
        listener.close()


def _drop_new_connections(sock) -> bool:
    """Attach a classic BPF program that drops every packet (Linux): SYNs to the listener are
    dropped, so no connection joins its accept queue. False where this is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    drop_all = ctypes.create_string_buffer(struct.pack("HBBI", BPF_RET_K, 0, 0, 0))
    program = struct.pack("HL", 1, ctypes.addressof(drop_all))
    try:
        with socket.socket(fileno=os.dup(sock.fileno())) as handle:
            handle.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, program)
    except OSError:
        return False
    return True


def _pending(sockets) -> bool:
    """Whether a connection waits in one of these listeners' accept queues."""
    readable, _, _ = select.select([sock.fileno() for sock in sockets], [], [], 0)
    return bool(readable)


def uvicorn_config(app, config: ServerConfig, **options) -> uvicorn.Config:
    """How kiln runs under uvicorn: uvloop, httptools with the header timeout and a shutdown
    that answers requests already sent (kiln.serving.protocol). `options` go to uvicorn."""
    metrics = app.state.kiln.metrics
    protocol = guarded_protocol(config.header_timeout_s, metrics.header_timeouts.inc)
    settings = {
        "host": config.host,
        "port": config.port,
        "log_level": "info",
        "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S,
        "loop": "uvloop",
        "http": protocol,
        **options,
    }
    return uvicorn.Config(app, **settings)


def serve(predictor: Predictor, config: ServerConfig | None = None) -> None:
    config = config or ServerConfig()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app = create_app(predictor, config)
    server = DrainingServer(uvicorn_config(app, config), app.state.kiln)
    print(
        f"serving {config.model_name} on http://{config.host}:{config.port} "
        "(Ctrl-C or SIGTERM drains, then stops)",
        flush=True,
    )
    server.run()
