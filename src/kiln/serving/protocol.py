"""uvicorn's httptools HTTP/1.1 protocol with the two guards a server facing every client needs:

- a header timeout (nginx's client_header_timeout): a request's headers must be complete within
  server.header_timeout_s of the connection opening, or of its previous answer. uvicorn's own
  keep-alive timer stops at the first byte, so a client that connects and sends nothing -- or
  trickles half a request line -- otherwise holds a connection (and a file descriptor) for ever.
- a shutdown that reads before it closes: uvicorn closes an idle kept-alive connection at once,
  resetting a request the client has just sent on it (httpx.ReadError, no server line). Here an
  idle connection is read for SHUTDOWN_LINGER_S first, so a request already on its way is
  answered (503 with Connection: close, as every answer is once draining), then closed.

They hook uvicorn internals (cycle, pipeline, on_headers_complete, on_response_complete,
shutdown); tests/test_serving_slow_clients.py fails if uvicorn changes them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

SHUTDOWN_LINGER_S = 0.05  # within uvicorn's 0.1 s pause before it waits for connections


def guarded_protocol(header_timeout_s: float, on_header_timeout: Callable[[], None]) -> type:
    """The protocol class for uvicorn.Config(http=...)."""

    class GuardedHttpProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._busy():
                self._arm_header_timer()  # the next request's headers are due from now

        def shutdown(self) -> None:
            if self._busy():
                super().shutdown()  # answers the request in progress, then closes
                return
            self.loop.call_later(SHUTDOWN_LINGER_S, self._close_unless_busy)

        # --- helpers ---------------------------------------------------------------------

        def _busy(self) -> bool:
            """A request's headers are in and its answer is not complete (or one is queued)."""
            in_progress = self.cycle is not None and not self.cycle.response_complete
            return in_progress or bool(self.pipeline)

        def _close_unless_busy(self) -> None:
            if self._busy():
                if self.cycle is not None:
                    self.cycle.keep_alive = False  # answered (503 while draining), then closed
            elif not self.transport.is_closing():
                self.transport.close()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self._busy() and not self.transport.is_closing():
                on_header_timeout()
                self.transport.close()

    return GuardedHttpProtocol
