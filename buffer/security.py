"""ZeroMQ CURVE for the buffer: keys from files, a ZAP authenticator thread on the server side.

Make the keys once, with pyzmq itself (see docs/buffer.md)::

    import zmq.auth
    zmq.auth.create_certificates("keys/server", "buffer")    # buffer.key (public), buffer.key_secret
    zmq.auth.create_certificates("keys/clients", "actor0")   # one pair per client host or role

The server gets its secret file (``--curve_secret_key keys/server/buffer.key_secret``) and a
directory that holds the *public* files of the clients it lets in (``--curve_client_keys``; put only
the ``.key`` files there). A client gets the server's public file and its own secret file
(``BufferClient(..., curve_server_key=..., curve_client_key=...)``). Traffic is then encrypted, and a
client whose key is not in the directory never completes the handshake: its requests time out
(ZeroMQ does not tell the client why; the server logs the refusal at DEBUG).
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


def load_secret(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of a ``.key_secret`` file. Raises ValueError if it holds no secret key."""
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise ValueError(f"{path} holds no secret key: give the `.key_secret` file of "
                         f"zmq.auth.create_certificates, not the public `.key` one")
    return public, secret


def load_public(path: str | os.PathLike) -> bytes:
    """The public Z85 key of a ``.key`` (or ``.key_secret``) file."""
    public, _ = zmq.auth.load_certificate(str(path))
    return public


class CurveServer:
    """Server side: starts a ZAP authenticator on ``ctx`` that admits the public keys in ``client_keys``."""

    def __init__(self, ctx: zmq.Context, secret_key_file: str | os.PathLike, client_keys: str | os.PathLike) -> None:
        if not Path(client_keys).is_dir():
            raise ValueError(f"client keys directory {client_keys} does not exist")
        self.public, self._secret = load_secret(secret_key_file)
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(client_keys))

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server (call before bind)."""
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()


def apply_client_keys(sock: zmq.Socket, server_public_file: str | os.PathLike,
                      client_secret_file: str | os.PathLike) -> None:
    """Make ``sock`` a CURVE client of the server whose public key file is given (call before connect)."""
    public, secret = load_secret(client_secret_file)
    sock.curve_serverkey = load_public(server_public_file)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
