"""ZeroMQ tcp addresses with IPv6 hosts: ``tcp://[::1]:5555`` binds and connects only on a socket whose
``ZMQ_IPV6`` option is on (off by default: zmq fails to bind such an address with "No such device", and a
connect to it never completes). Every socket the project binds or connects goes through :func:`allow_ipv6`
before its first bind or connect.

The option is turned on only for a bracketed IPv6 literal: on for a name such as ``localhost``, zmq could
resolve it to ``::1`` and connect there while the peer listens on ``127.0.0.1``.
"""

from __future__ import annotations

import re

import zmq

_IPV6_HOST = re.compile(r"^tcp://\[[^\]]*:[^\]]*\](:|$)")  # a colon inside the brackets


def is_ipv6(address: str) -> bool:
    """True for ``tcp://[IPV6]:PORT`` (or ``tcp://[IPV6]``, as ``bind_to_random_port`` takes it); False for
    IPv4, names, ``*``, ``ipc://`` and ``inproc://`` addresses. Never raises."""
    return bool(_IPV6_HOST.match(address))


def allow_ipv6(sock: zmq.Socket, address: str) -> zmq.Socket:
    """Turn ``ZMQ_IPV6`` on for ``sock`` when ``address`` (the one it will bind or connect) has an IPv6 host;
    call it before the bind or connect. Returns ``sock``. Raises zmq.ZMQError only if the socket is closed."""
    if is_ipv6(address):
        sock.setsockopt(zmq.IPV6, 1)
    return sock
