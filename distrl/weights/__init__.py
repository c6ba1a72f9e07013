"""Policy-version weight publication: announcement protocol (base) and transports (fs)."""

from distrl.weights.base import BASE, Announcement, WeightError, WeightPublisher, WeightSubscriber
from distrl.weights.fs import DirectoryTransport, directory_digest, fetch

__all__ = ["BASE", "Announcement", "WeightError", "WeightPublisher", "WeightSubscriber",
           "DirectoryTransport", "directory_digest", "fetch"]
