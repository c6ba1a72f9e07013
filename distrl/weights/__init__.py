"""Policy-version weight publication: the announcement protocol (base) and its transports (fs, zmq)."""

from pathlib import Path

from distrl.weights.base import BASE, Announcement, WeightError, WeightPublisher, WeightSubscriber
from distrl.weights.fs import DirectoryTransport, FsFetcher, directory_digest, fetch
from distrl.weights.zmq import ZmqFetcher

TRANSPORTS = ("fs", "zmq")


def make_fetcher(transport: str, endpoint: str, cache_dir: str | Path):
    """The actor-side fetcher of `transport`: `fs` (shared directory) or `zmq` (download from `endpoint`)."""
    if transport == "fs":
        return FsFetcher()
    if transport == "zmq":
        return ZmqFetcher(endpoint, cache_dir)
    raise ValueError(f"unknown weights transport {transport!r}; expected one of {TRANSPORTS}")


__all__ = ["BASE", "TRANSPORTS", "Announcement", "WeightError", "WeightPublisher", "WeightSubscriber",
           "DirectoryTransport", "FsFetcher", "ZmqFetcher", "directory_digest", "fetch", "make_fetcher"]
