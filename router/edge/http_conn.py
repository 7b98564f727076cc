"""HTTP connections with clocks: aiohttp's connection handler, closing a connection that sits
idle past the keep-alive timeout or takes too long to send a request's headers (slowloris), and
the listening site that makes its connections so. The body's clock is the handler's
(`router/edge/http_server.py`), since only the handler reads the body.

aiohttp's own keep-alive clock runs from a connection's start or last answer and closes it while
it waits for a complete request, headers half-sent or not; these clocks tell idle apart from
headers under way, so that each has its own timeout."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from pdserve.router.edge.http_options import HttpOptions

log = logging.getLogger(__name__)

# aiohttp's keep-alive clock, pushed out of the way of ours (it must stay positive: aiohttp arms
# it after every answer, and at 0 would close each connection as soon as it was idle).
_AIOHTTP_KEEPALIVE_S = 365 * 24 * 3600.0


class TimedRequestHandler(web.RequestHandler):
    """One HTTP connection. Idle (no request under way): closed after `keep_alive_s`. A request's
    first byte starts its header clock: closed unless the request reaches the application
    (`request_started`, from `timed_requests`) within `header_s`. Busy: no clock here."""

    def __init__(self, manager: Any, *, options: HttpOptions, **kwargs: Any) -> None:
        super().__init__(manager, keepalive_timeout=_AIOHTTP_KEEPALIVE_S, **kwargs)
        self._options = options
        self._clock: asyncio.TimerHandle | None = None
        self._idle = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm(self._options.keep_alive_s, "idle")

    def data_received(self, data: bytes) -> None:
        if self._idle and data:
            self._idle = False
            self._arm(self._options.header_s, "headers")
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def request_started(self) -> None:
        """The request's headers are in and the application has it: no clock until its answer is sent."""
        self._idle = False
        self._disarm()

    async def finish_response(self, request: Any, resp: Any, start_time: Any) -> Any:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._idle = True
            if self.transport is not None:
                self._arm(self._options.keep_alive_s, "idle")

    def _arm(self, delay_s: float, what: str) -> None:
        self._disarm()
        self._clock = self._loop.call_later(delay_s, self._expire, what, delay_s)

    def _disarm(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None

    def _expire(self, what: str, delay_s: float) -> None:
        self._clock = None
        peer = None if self.transport is None else self.transport.get_extra_info("peername")
        log.debug("closing HTTP connection from %s: %s past %g s", peer, what, delay_s)
        self.force_close()


@web.middleware
async def timed_requests(request: web.Request, handler: Any) -> web.StreamResponse:
    """Stops the connection's header clock as the request reaches the application (first in
    the middleware chain, so that it runs before any other work)."""
    protocol = request.protocol
    if isinstance(protocol, TimedRequestHandler):
        protocol.request_started()
    return await handler(request)


class TimedTCPSite(web.TCPSite):
    """aiohttp's TCP site, its connections made as `TimedRequestHandler`s."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, options: HttpOptions,
                 handler_args: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        self._options = options
        self._handler_args = handler_args

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None

        def connection() -> TimedRequestHandler:
            return TimedRequestHandler(server, loop=loop, options=self._options, **self._handler_args)

        self._server = await loop.create_server(
            connection, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
