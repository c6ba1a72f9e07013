"""ZeroMQ CURVE for distrl's sockets (the buffer's and the weight broadcast's): keys from files, the run's in-memory
keys, a ZAP authenticator thread on the server side.

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

`distrl train` keys its run in memory instead (:class:`RunKeys`): when its roles bind off loopback the driver
makes one key pair for the buffer, one for learner 0's weight endpoints and one for every client, and hands
them to each role through Ray; :func:`use_run_keys` makes them the process's keys, which every server
(:class:`distrl.buffer.endpoint.Endpoint`, :class:`distrl.weights.base.WeightPublisher`) and client socket made
afterwards uses (:func:`serve_run_keys`, :func:`connect_run_keys`). The servers admit the run's client key
only. Nothing is written to disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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


class _Allowed:
    """A ZAP credentials provider that admits exactly the Z85 public keys it holds."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class CurveServer:
    """Server side: starts a ZAP authenticator on ``ctx`` that admits the public keys in ``client_keys``
    (a directory of ``.key`` files), or with ``pair`` (public, secret) the Z85 keys in ``client_keys`` (a set).
    Raises ValueError for a missing directory or a file without a secret key."""

    def __init__(self, ctx: zmq.Context, secret_key_file: str | os.PathLike | None,
                 client_keys: str | os.PathLike | set[bytes], pair: tuple[bytes, bytes] | None = None) -> None:
        if pair is None and not Path(client_keys).is_dir():
            raise ValueError(f"client keys directory {client_keys} does not exist")
        self.public, self._secret = pair if pair is not None else load_secret(secret_key_file)
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        if pair is None:
            self._auth.configure_curve(domain="*", location=str(client_keys))
        else:
            self._auth.configure_curve_callback(domain="*", credentials_provider=_Allowed(set(client_keys)))

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


@dataclass(frozen=True, repr=False)
class RunKeys:
    """A `distrl train` run's CURVE keys, (public, secret) Z85 pairs: the buffer's, learner 0's weight endpoints'
    (announcement PUB and LATEST/FETCH ROUTER) and the one every client (role or driver) presents."""

    buffer: tuple[bytes, bytes]
    weights: tuple[bytes, bytes]
    client: tuple[bytes, bytes]

    @classmethod
    def make(cls) -> "RunKeys":
        """Three fresh key pairs (``zmq.curve_keypair``)."""
        return cls(zmq.curve_keypair(), zmq.curve_keypair(), zmq.curve_keypair())

    def __repr__(self) -> str:  # never print a secret key (logs, Ray's error messages)
        return f"RunKeys(buffer={self.buffer[0].decode()}, weights={self.weights[0].decode()}, client=...)"


_RUN_KEYS: RunKeys | None = None


def use_run_keys(keys: RunKeys | None) -> None:
    """Make ``keys`` the keys of every run socket this process makes from now on (None: plain TCP again)."""
    global _RUN_KEYS
    _RUN_KEYS = keys


def run_keys() -> RunKeys | None:
    """The process's run keys (:func:`use_run_keys`), or None."""
    return _RUN_KEYS


def serve_run_keys(ctx: zmq.Context, server: str) -> CurveServer | None:
    """With run keys: a CurveServer on ``ctx`` with the ``server`` pair (``buffer`` or ``weights``) that admits
    only the run's client key (``apply`` it to each server socket, ``stop`` it before ``ctx.term``); else None."""
    keys = run_keys()
    if keys is None:
        return None
    return CurveServer(ctx, None, {keys.client[0]}, pair=getattr(keys, server))


def connect_run_keys(sock: zmq.Socket, server: str) -> None:
    """With run keys: make ``sock`` a CURVE client of the ``server`` (``buffer`` or ``weights``) with the run's
    client pair (call before connect); else nothing."""
    keys = run_keys()
    if keys is not None:
        sock.curve_serverkey = getattr(keys, server)[0]
        sock.curve_publickey, sock.curve_secretkey = keys.client
