"""The buffer's config section: how it selects training data, its memory and disk bounds, its endpoint.

Torch-free, owned by the buffer. ``distrl/cmd/config.py`` composes these sections with the foundation's
(``distrl/core/run_options.py``) into `distrl buffer`'s and `distrl train`'s configs and holds the rules that
join two sections (``--topk`` against ``--group_size``). Each section's ``check`` raises ValueError naming
the first bad flag and never changes the config; ``resolve`` computes its derived values at construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

GiB, MiB = 2**30, 2**20
DEFAULT_BUFFER_ADDRESS = "tcp://127.0.0.1:5555"


@dataclass
class TopkOptions:
    """How much of each group trains (with --group_size: the rule joining them is in distrl/cmd/config.py)."""

    topk: Optional[int] = None
    """Completions kept per group for training, the k best by --topk_by (unset: all n)."""


@dataclass
class SelectionOptions:
    """How the buffer picks training data; shared by `distrl train`, `distrl buffer` and `distrl replay`."""

    topk_by: Literal["reward", "abs_advantage"] = "reward"
    """Which completions of a group `--topk` keeps: the k largest `reward` or the k largest `|advantage|`
    (ties go to the earlier completion)."""
    order: Literal["fifo", "freshest", "variance"] = "fifo"
    """Which fresh groups a version's batch takes first: `fifo` (oldest PUT first), `freshest` (newest
    policy version first, then newest PUT) or `variance` (largest reward variance first, then oldest)."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal (no GRPO signal) on arrival. They stay in the segment log,
    are counted as evictions `zero_variance`, give their credit back, and WAIT replies say how many."""
    max_filtered_groups: int = 2000
    """With --filter_zero_variance: after this many groups in a row were dropped (any group that varies
    resets the count) the run stops with an error (exit 1): a reward that scores every completion the
    same can never train. 0: never stop. 2000 stops such a run within a minute on the tiny model (the
    2-core VM makes 50-200 groups/s: 10-40 s) yet spares a sparse reward: if 1% of groups vary, 2000
    flat ones in a row have odds 0.99^2000 ~ 2e-9."""
    replay_ratio: int = 1
    """Times a group may be handed out, each time to a later version and within `--max_staleness`
    (1: each group trains once; more reuses data, off-policy)."""
    bias_slack: int = 0
    """Extra versions of staleness (beyond --max_staleness) for a group with a learning signal whose (length,
    difficulty) cell the learners under-train: its share of the groups trained so far is below its share of
    those generated (the sampling-bias monitor's histograms, docs/offpolicy.md). The late groups the asynchrony
    would drop as stale (long, slow, hard problems) are trained instead, their importance ratios clipped by the
    loss; the allowance stops once the cell is trained in proportion. 0: off."""
    credit_timeout_s: float = 60.0
    """Seconds an actor holding unused credits may stay silent (no CREDIT, PUT or other request) before the
    buffer counts it lost (killed, node gone) and its credits return to the pool (logged). Longer than one
    generate call of your actors: credits taken from a live, slow actor let the run exceed AReaL's rule
    (counted as `credit_violations`). An actor that stops cleanly says LEAVE and its credits return at once."""

    def check(self) -> None:
        """Raise ValueError naming the first bad selection option."""
        if self.topk_by not in ("reward", "abs_advantage"):
            raise ValueError(f"--topk_by must be reward or abs_advantage, got {self.topk_by!r}")
        if self.order not in ("fifo", "freshest", "variance"):
            raise ValueError(f"--order must be fifo, freshest or variance, got {self.order!r}")
        if self.replay_ratio < 1:
            raise ValueError(f"--replay_ratio must be >= 1, got {self.replay_ratio}")
        if not self.credit_timeout_s > 0:
            raise ValueError(f"--credit_timeout_s must be > 0, got {self.credit_timeout_s}")
        if self.bias_slack < 0:
            raise ValueError(f"--bias_slack must be >= 0 (0: off), got {self.bias_slack}")
        if self.max_filtered_groups < 0:
            raise ValueError(f"--max_filtered_groups must be >= 0 (0: no limit), got {self.max_filtered_groups}")


@dataclass
class StorageOptions:
    """The buffer's memory bounds, frame limit and on-disk segment log; shared by `train` and `buffer`."""

    fsync: Literal["always", "batch", "never"] = "batch"
    """When the logs reach the disk. Every write is flushed to the OS before its reply (a killed buffer
    loses nothing). `always`: fsync each group and each consumption record before replying. `batch`:
    the commit thread writes every group accepted since its last commit and fsyncs the segment log
    once, before any of their ACKs (an ACK still means on disk), and the consumption log within a second.
    `never`: leave it to the OS (a power loss may lose acknowledged groups)."""
    max_rows: int = 1_000_000
    """Completions the buffer holds in memory (whole groups; top-k is cut when a batch is taken); when
    full, credits stop and PUTs are refused."""
    max_bytes: int = 4 * GiB
    """Arrow bytes the buffer holds in memory (same effect as --max_rows when reached)."""
    max_msg_bytes: int = 256 * MiB
    """Largest message accepted, in bytes (ZMQ_MAXMSGSIZE): a peer that sends more is disconnected."""
    prefault_bytes: int = 512 * MiB
    """Heap the buffer writes once at start (at most --max_bytes and half the memory the process may use;
    0: none) so that received groups land in memory already written and freed groups' memory is reused
    (glibc; docs/buffer.md, "Ingest")."""
    dedup_window: int = 1 << 20
    """Sample ids the buffer remembers (at least the last this many accepted, about twice at most) to
    drop re-sent PUTs as duplicates: bounded memory in a long run. A client's retries end within
    minutes (30 s x 6 sends by default); a PUT re-sent after more newer completions is accepted again."""
    segment_max_bytes: int = 256 * MiB
    """A segment file is closed and a new one started once it reaches this size, in bytes."""
    retention_bytes: Optional[int] = None
    """Delete the oldest closed segments beyond this total size, in bytes (unset: keep all). Only
    segments whose groups have all left memory are deleted."""
    retention_s: Optional[float] = None
    """Delete closed segments older than this, in seconds (unset: keep all); same rule as above."""

    def check(self) -> None:
        """Raise ValueError naming the first bad storage option."""
        if self.fsync not in ("always", "batch", "never"):
            raise ValueError(f"--fsync must be always, batch or never, got {self.fsync!r}")
        for name in ("max_rows", "max_bytes", "max_msg_bytes", "dedup_window", "segment_max_bytes",
                     "retention_bytes", "retention_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name} must be > 0, got {value}")
        if self.prefault_bytes < 0:
            raise ValueError(f"--prefault_bytes must be >= 0, got {self.prefault_bytes}")


def buffer_options(*sections) -> dict:
    """The fields of the SelectionOptions and StorageOptions among ``sections``, by name (what the buffer reads)."""
    return {f.name: getattr(section, f.name) for section in sections
            if isinstance(section, (SelectionOptions, StorageOptions)) for f in dataclasses.fields(section)}


@dataclass
class BufferEndpoint:
    """`distrl buffer`'s own options: where it binds, its run directory, restarting it, CURVE keys."""

    address: str = DEFAULT_BUFFER_ADDRESS
    """Where the buffer binds (ZMQ endpoint; port 0 picks a free one). Loopback by default: bind another
    interface only with --curve_secret_key, or on a network you trust."""
    run_dir: Optional[str] = None
    """Run directory: segments/, consumed.jsonl, buffer.json (address, pid, config) and tb/buffer0/
    (with --resume: that directory)."""
    resume: Optional[str] = None
    """Resume a stopped or killed buffer from this run directory: rebuild held groups, seen sample ids and
    the last selection from its segments and consumption log, then keep writing there."""
    resume_version: Optional[int] = None
    """With --resume, when the learner restarts from an older checkpoint (`distrl learn --resume`): the
    checkpoint's version; selections made after it are rolled back and their groups served again
    (docs/faults.md). Unset: keep every selection."""
    curve_secret_key: Optional[str] = None
    """Turn on CURVE encryption and authentication: the server's secret key file (`<name>.key_secret`,
    written by `zmq.auth.create_certificates`, see docs/buffer.md)."""
    curve_client_keys: Optional[str] = None
    """With --curve_secret_key: directory of the public key files (`*.key`) of the clients let in."""
    tb_dir: Optional[str] = None
    """TensorBoard directory (unset: `<run_dir>/tb/buffer0`)."""
    replica: Optional[str] = None
    """ZMQ address of a replica of the log (`python -m distrl.buffer.replica DIR` on another host, plain TCP):
    a PUT is acknowledged, and a batch handed out, only once its record is in the replica too; with --resume
    on a host that lost the log, the replica's copy is fetched first (docs/buffer.md). Unset: no replica."""

    def resolve(self) -> None:
        """--resume gives the run directory; raises ValueError when --run_dir names another one."""
        if self.resume is not None:
            if self.run_dir is not None and Path(self.run_dir).resolve() != Path(self.resume).resolve():
                raise ValueError(f"--run_dir {self.run_dir} differs from --resume {self.resume}: give one")
            self.run_dir = self.resume

    def check(self) -> None:
        """Raise ValueError naming the first bad endpoint option."""
        if self.resume_version is not None and (self.resume is None or self.resume_version < 0):
            raise ValueError(f"--resume_version needs --resume and must be >= 0, got {self.resume_version}")
        if self.resume is not None and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume}: no such run directory")
        if self.run_dir is None:
            raise ValueError("give --run_dir (a new buffer) or --resume <run_dir> (restart one)")
        if (self.curve_secret_key is None) != (self.curve_client_keys is None):
            raise ValueError("--curve_secret_key and --curve_client_keys go together (server key, allowed clients)")
        for name in ("curve_secret_key", "curve_client_keys"):
            if getattr(self, name) is not None and not Path(getattr(self, name)).exists():
                raise ValueError(f"--{name} {getattr(self, name)}: no such file or directory")
