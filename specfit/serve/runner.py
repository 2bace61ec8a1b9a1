"""Running the app under uvicorn: in the foreground (``specfit serve``, SIGTERM -> exit 0) or on a
background thread (tests, the benchmark), each on a socket bound before uvicorn starts, so that the
port taken (``server.port=0``: any free one) is known and a port in use is one clear error."""

from __future__ import annotations

import signal
import socket
import threading
import time
from types import FrameType
from typing import Any

import uvicorn

from specfit.config import ServerConfig
from specfit.errors import ConfigError
from specfit.serve.app import create_app


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, or a one-line ConfigError naming the setting."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"server.host={host}: cannot resolve it ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"server.port={port}: cannot listen on {host}:{port} ({exc.strerror or exc}); choose "
                          "another port (server.port=0 takes any free one)") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, where SIGTERM drains the queue at once and the process then exits 0
    (uvicorn re-raises the signal after its shutdown, which would end it by SIGTERM instead)."""

    def __init__(self, config: uvicorn.Config, worker: Any) -> None:
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM:
            self.worker.drain()
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


def _config(app: Any, settings: ServerConfig) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=settings.log_level, lifespan="on", access_log=False,
                          timeout_graceful_shutdown=int(settings.shutdown_timeout) + 2, timeout_keep_alive=5)


def serve_forever(engine: Any, settings: ServerConfig, announce: Any = print) -> None:
    """Serve ``engine`` until SIGTERM or Ctrl-C; ``announce`` gets the address line."""
    sock = bind(settings.host, settings.port)
    app = create_app(engine, settings)
    server = _Server(_config(app, settings), app.state.worker)
    host, port = sock.getsockname()[:2]
    announce(f"specfit serve: http://{host}:{port}/v1 (model {settings.model_name!r}; /health, /metrics; "
             "SIGTERM or Ctrl-C stops)")
    server.run(sockets=[sock])


class BackgroundServer:
    """The app on a thread, on ``127.0.0.1`` and a free port: ``with BackgroundServer(engine) as s: s.url``."""

    def __init__(self, engine: Any, settings: ServerConfig | None = None, start_timeout: float = 120.0) -> None:
        self.settings = settings or ServerConfig(port=0)
        self.sock = bind(self.settings.host, self.settings.port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{self.settings.host}:{self.port}"
        self.app = create_app(engine, self.settings)
        self.server = _Server(_config(self.app, self.settings), self.app.state.worker)
        self.start_timeout = start_timeout
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="specfit-serve")

    @property
    def worker(self) -> Any:
        return self.app.state.worker

    def start(self, wait_ready: bool = True) -> BackgroundServer:
        self.thread.start()
        end = time.monotonic() + self.start_timeout
        while not self.server.started or (wait_ready and self.worker.state() == "starting"):
            if time.monotonic() > end or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start within {self.start_timeout} s")
            time.sleep(0.02)
        if wait_ready and self.worker.state() != "ok":
            raise RuntimeError(f"the server is not ready: {self.worker.state()} {self.worker.failure or ''}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.worker.drain()
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
