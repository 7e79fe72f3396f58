"""Run the app under uvicorn (`python infer.py mode=serve ...`), with a drain on SIGTERM/SIGINT:

1. at once: readiness (/readyz, /v2/health/ready) answers 503 and new inference requests get
   503 with Retry-After, while the listener stays open so clients see an answer, not a refusal;
2. every request admitted before is answered -- within server.drain_grace_s, which start-up
   checks is longer than server.timeout_ms, so at worst they get their 504 in time; should the
   grace still run out, the queue is cut with 503s (never 500s);
3. then uvicorn closes the listener and the process exits with status 0.

A second signal stops waiting: the queue is cut at once."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvicorn

from kiln.config.infer import ServerConfig
from kiln.inference import Predictor
from kiln.serving.app import create_app
from kiln.serving.state import ServingState

log = logging.getLogger(__name__)

# Python hands the GIL to a waiting thread only every switch interval (5 ms by default): the
# model thread, waiting for it between torch ops while the event loop parses requests, would
# spend most of a small model call waiting. 0.5 ms keeps the model thread fed.
GIL_SWITCH_INTERVAL_S = 0.0005
AFTER_CUT_WAIT_S = 30.0  # after cutting the queue: time for the model call in progress
GRACEFUL_SHUTDOWN_S = 5.0  # uvicorn's own wait for connections, once nothing is in flight


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServingState):
        super().__init__(config)
        self.state = state
        self.drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        """Called on SIGTERM/SIGINT, in the main thread. Unlike uvicorn's, it does not re-raise
        the signal after shutdown: a drained server exits with status 0."""
        loop = self.state.loop
        if loop is None:  # not started yet: nothing admitted, nothing to drain
            self.should_exit = True
            return
        if self.state.draining:
            log.warning("second signal %s: cutting the queue now", signal.Signals(sig).name)
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
        log.info("drained: every admitted request answered; shutting down")
        self.should_exit = True


def serve(predictor: Predictor, config: ServerConfig | None = None) -> None:
    config = config or ServerConfig()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app = create_app(predictor, config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = DrainingServer(uv_config, app.state.kiln)
    print(
        f"serving {config.model_name} on http://{config.host}:{config.port} "
        "(Ctrl-C or SIGTERM drains, then stops)",
        flush=True,
    )
    server.run()
