"""Serving the app: uvicorn on uvloop, a bounded exit on SIGTERM/SIGINT, a leak check.

`serve` blocks until a signal. Shutdown, the same whichever signal and however the
server is stopped: uvicorn stops accepting connections and closes the idle ones; the
requests in flight may finish for ``shutdown_timeout`` seconds (vLLM's
``--shutdown-timeout``, default 0: not at all); then, or at once on a second signal,
every rank aborts what it still has (counted ``finished_reason="abort"``, as vLLM
counts its shutdown's aborts) and every connection still open is dropped, a client that
stopped reading included, so each handler ends through its disconnect path and frees
its requests. Then the app's lifespan lets the engines drain and checks that every pool
is back to zero active blocks. The exit status is 0 then, 1 if a block leaked. No
signal skips that check (uvicorn's "force exit" on a second Ctrl-C would: it is never
used). `running_server` runs the same server inside an existing asyncio loop (tests,
benchmarks) on a port the OS picks.

Once started, `serve` marks the startup heap static (``gc.freeze``), as vLLM's server
does: the oldest generation's collections then skip the imports and the engines, and a
500-stream load's pauses for them fell from about 130 ms to about 70 ms
(benchmarks/README.md). `running_server` does it only when asked (``freeze_gc``): it
shares its process with its caller, whose heap is not the server's to freeze.
"""

from __future__ import annotations

import gc
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import anyio
import uvicorn

from kvpool.engine.clock import event_loop
from kvpool.serve.app import build_app
from kvpool.serve.state import ServeState


def _loop() -> str:
    """uvicorn's name for the loop `event_loop` picks (uvloop when installed)."""
    return "uvloop" if event_loop("auto")[1].get("use_uvloop") else "asyncio"


class _Server(uvicorn.Server):
    """uvicorn's server, with three changes: it announces the address it bound (the port
    the OS picked for port 0); its shutdown is bounded (see the module doc); and it exits
    normally after SIGTERM/SIGINT instead of re-raising the signal (which would end the
    process with the signal's status instead of 0)."""

    def __init__(self, config: uvicorn.Config, state: ServeState, shutdown_timeout: float):
        if not shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout}")
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.signals = 0  # SIGTERM/SIGINT received

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a signal handler: note it, the shutdown task acts on it (never force_exit,
        # which would skip the engines' drain and the leak check)
        self.signals += 1
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._abort_at_deadline)
            await super().shutdown(sockets)
            tasks.cancel_scope.cancel()

    async def _abort_at_deadline(self) -> None:
        """Wait out ``shutdown_timeout`` (or a second signal, however soon after the
        first), then abort everything still in flight."""
        with anyio.move_on_after(self.shutdown_timeout):
            while self.signals < 2:
                await anyio.sleep(0.02)
        for driver in self.state.drivers:
            driver.abort_all()
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()  # its handler sees the client gone, and ends

    @property
    def bound(self) -> tuple[str, int] | None:
        """The (host, port) of the first listening socket, once started."""
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                return str(host), int(port)
        return None


def _config(state: ServeState, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        build_app(state),
        host=host,
        port=port,
        loop=_loop(),
        http="auto",  # httptools when installed (the serve extra), else h11
        lifespan="on",
        log_level=log_level,
        access_log=log_level == "debug",
    )


def _freeze_startup_heap() -> None:
    gc.collect()
    gc.freeze()


def serve(
    state: ServeState,
    host: str,
    port: int,
    *,
    log_level: str = "warning",
    shutdown_timeout: float = 0,
) -> int:
    """Serve until SIGTERM/SIGINT; return 0, or 1 if a KV block leaked."""
    server = _Server(_config(state, host, port, log_level), state, shutdown_timeout)

    async def announce() -> None:
        while not server.started and not server.should_exit:
            await anyio.sleep(0.01)
        if server.started:
            _freeze_startup_heap()
        if server.bound is not None:
            bound_host, bound_port = server.bound
            print(
                f"kvpool serve: listening on http://{bound_host}:{bound_port} "
                f"(model {state.model_name!r}, {len(state.drivers)} rank(s))",
                file=sys.stderr,
                flush=True,
            )

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(announce)
            await server.serve()

    backend, options = event_loop("auto")
    anyio.run(main, backend=backend, backend_options=options)
    if not server.started:
        return 1  # it could not bind, or the engines did not start (uvicorn logged why)
    leaked = state.leaked_blocks
    aborted = state.shutdown_aborted
    print(
        f"kvpool serve: shut down; {aborted} request(s) aborted at the shutdown timeout",
        file=sys.stderr,
    )
    if leaked:
        print(f"kvpool serve: {leaked} KV blocks still active at exit", file=sys.stderr)
        return 1
    print("kvpool serve: no KV block left active", file=sys.stderr)
    return 0


@asynccontextmanager
async def running_server(
    state: ServeState,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    freeze_gc: bool = False,
    shutdown_timeout: float = 0,
) -> AsyncIterator[str]:
    """Run the server in this (asyncio) loop; yield its base URL (``http://host:port``).

    With ``freeze_gc``, the heap is marked static once the server started, as `serve`
    does (see the module doc). On exit it shuts down as on SIGTERM: the requests in
    flight may finish for ``shutdown_timeout`` seconds, then they are aborted, and the
    engines drain.
    """
    server = _Server(_config(state, host, port, log_level), state, shutdown_timeout)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(server._serve)  # without signal capture: the caller owns those
        while not server.started:
            if server.should_exit:
                raise RuntimeError("the server failed to start")
            await anyio.sleep(0.005)
        bound = server.bound
        assert bound is not None
        if freeze_gc:
            _freeze_startup_heap()
        try:
            yield f"http://{bound[0]}:{bound[1]}"
        finally:
            server.should_exit = True


def routable_host(host: str) -> str:
    """``host``, or this machine's address when ``host`` is a wildcard (for topics
    and logs that must name the server to someone else)."""
    if host in ("", "0.0.0.0", "::", "*"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host


__all__ = ["routable_host", "running_server", "serve"]
