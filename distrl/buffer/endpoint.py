"""The buffer's endpoint: a ZeroMQ ROUTER socket bound to one address, with its context and CURVE.

:class:`distrl.buffer.server.BufferServer` reads and answers requests on :attr:`Endpoint.socket`;
:func:`distrl.buffer.assemble.build_buffer` makes the endpoint. Requests that arrive before the server serves
wait in the socket's queue.
"""

from __future__ import annotations

import logging
import re

import zmq

from distrl.core.errors import BindError
from distrl.core.security import CurveServer, serve_run_keys
from distrl.core.tcp import allow_ipv6

log = logging.getLogger(__name__)

DEFAULT_MAX_MSG_BYTES = 256 * 2**20
LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")


def bindable(address: str) -> str:
    """``tcp://host:0`` -> ``tcp://host:*`` (zmq's spelling of "any free port")."""
    return re.sub(r":0$", ":*", address)


class Endpoint:
    """A ROUTER socket bound to ``address`` (``.address`` holds the real endpoint, the port picked).

    Args:
        address: zmq endpoint, e.g. ``tcp://127.0.0.1:5555``; port 0 or ``*`` picks a free port.
        max_msg_bytes: largest accepted message (ZMQ_MAXMSGSIZE); a peer sending more is disconnected.
        curve_secret_key, curve_client_keys: CURVE from key files (:mod:`distrl.core.security`); None: the process's
            run keys (``distrl.core.security.use_run_keys``, `distrl train`), or plain TCP without them.
    Raises BindError (saying what to change) if the address cannot be bound; nothing stays open then.
    """

    def __init__(self, address: str, max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES,
                 curve_secret_key: str | None = None, curve_client_keys: str | None = None) -> None:
        self._ctx = zmq.Context()
        self._curve = None
        try:
            if curve_secret_key is not None:
                self._curve = CurveServer(self._ctx, curve_secret_key, curve_client_keys)
            else:
                self._curve = serve_run_keys(self._ctx, "buffer")
            self.socket = self._bind(address, max_msg_bytes)
        except BaseException:
            self._stop_context()
            raise
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._closed = False

    def _bind(self, address: str, max_msg_bytes: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        allow_ipv6(sock, address)
        if self._curve is not None:
            self._curve.apply(sock)
        try:
            sock.bind(bindable(address))
        except zmq.ZMQError as exc:
            sock.close()
            raise BindError(f"buffer cannot bind {address}: {exc} (pick another port, or 0)") from None
        host = address.split("://")[-1].rsplit(":", 1)[0]
        if self._curve is None and host not in LOOPBACK and "ipc://" not in address:
            log.warning("buffer bound to %s without CURVE: anyone who reaches it can PUT and GET", address)
        return sock

    def _stop_context(self) -> None:
        if self._curve is not None:
            self._curve.stop()
        self._ctx.term()

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket (waiting up to ``linger_ms`` for queued replies to leave), CURVE and the context
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.socket.close(linger=linger_ms)
        self._stop_context()
