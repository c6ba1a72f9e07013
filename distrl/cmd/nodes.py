"""`distrl train` across Ray nodes with no shared filesystem (docs/multinode.md).

Once the placement says on which node each role runs (:mod:`distrl.cmd.placement`), the driver asks each of
those nodes, with one small Ray task pinned to it (:func:`probe_nodes`), what a role there would see:

* its address (``ray.util.get_node_ip_address()``): roles bind their endpoints on it when the run spans
  nodes (loopback, ``--host``, stays the default when every role is on the driver's node);
* whether it sees the driver's run directory (a shared filesystem, or the driver's own node) and the
  driver's ``--model`` directory (same file names and sizes);
* two free TCP ports (learner rank 0's node: the learners' process group and the nccl broadcast group).

From that, :func:`settle_transport` picks the weight transport (``shm`` when the actors run on learner 0's node,
the driver's, for full fine-tuning; else ``fs`` when learner 0 and the actors see one run directory, else
``zmq``) or refuses a transport the user picked that cannot work; :class:`ModelFiles` ships a ``--model``
directory of the driver's node through Ray's object store to roles on nodes that lack it; :class:`Gatherer`
copies what the roles on such nodes write (their logs, TensorBoard events, role files, actor 0's eval.jsonl)
into the driver's run directory, periodically and at the end; :func:`curve_keys` keys the run (CURVE) when a
role binds off loopback. No role ever reads a
file written on another node: each writes under the run directory's path *on its own node*, which is where
its segments (buffer) and checkpoints (learner rank 0) stay.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from distrl.core.errors import PreflightError

log = logging.getLogger("distrl.cmd.nodes")
CHUNK_BYTES = 64 * 2**20  # a shipped model file travels in objects of at most this many bytes
DRIVER_MARK = "roles/driver.json"  # the driver's nonce: a node that reads it sees the driver's run directory


@dataclass(frozen=True)
class NodeView:
    """What a role on one node sees. ``ports``: two TCP ports free there when it was probed."""

    node_id: str
    ip: str
    shares_run_dir: bool
    has_model: bool
    ports: tuple[int, int]


def model_manifest(model_dir: str) -> dict[str, int] | None:
    """Relative path -> size in bytes of every file under ``model_dir``; None when it is no directory here
    (a hub id: each node loads it from the hub itself)."""
    root = Path(model_dir)
    if not root.is_dir():
        return None
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def _probe(run_dir: str, nonce: str, model_dir: str, manifest: dict | None) -> tuple:
    """Runs on the probed node: (ip, shares run dir, has the model, two free ports)."""
    import ray

    ip = ray.util.get_node_ip_address()
    try:
        shares = json.loads((Path(run_dir) / DRIVER_MARK).read_text()).get("nonce") == nonce
    except (OSError, ValueError):
        shares = False
    has_model = manifest is None or model_manifest(model_dir) == manifest
    socks = [socket.socket() for _ in range(2)]
    try:
        for s in socks:
            s.bind((ip, 0))
        ports = tuple(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()
    return ip, shares, has_model, ports


def probe_nodes(node_ids: set[str], run_dir: Path, model_dir: str) -> dict[str, NodeView]:
    """Node id -> :class:`NodeView` for each of ``node_ids`` (one Ray task pinned to each, 0 CPUs).
    Writes the driver's mark into ``run_dir`` first. Raises what Ray raises for a node that is gone."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nonce = uuid.uuid4().hex
    mark = run_dir / DRIVER_MARK
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(json.dumps({"nonce": nonce, "pid": os.getpid(), "host": socket.gethostname()}))
    manifest = model_manifest(model_dir)
    probe = ray.remote(num_cpus=0)(_probe)
    refs = {node: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                str(run_dir), nonce, model_dir, manifest) for node in node_ids}
    return {node: NodeView(node, *ray.get(ref, timeout=120)) for node, ref in refs.items()}


def spans_nodes(nodes: dict[str, str], home: str) -> bool:
    """Whether the roles (``nodes``: role -> node id) and the driver (node ``home``) use more than one node."""
    return len(set(nodes.values()) | {home}) > 1


def weight_file_bytes(model_dir: str | None) -> int:
    """Bytes of the weight files (safetensors, bin, pt) under ``model_dir``; 0 when it is no directory here."""
    manifest = model_manifest(model_dir) if model_dir else None
    return sum(size for name, size in (manifest or {}).items() if name.endswith((".safetensors", ".bin", ".pt")))


def settle_transport(cfg, nodes: dict[str, str], views: dict[str, NodeView], local_model: str | None = None):
    """``cfg`` with a --weights_transport: the user's, or by default ``shm`` when every actor runs on learner 0's
    node, that node is this one (`local_model`: the model directory here), the run fine-tunes full weights and
    /dev/shm here has room for them; else ``fs`` when learner 0 and every actor see one run directory (one node,
    or a shared filesystem), else ``zmq``. Raises PreflightError (one line) for a
    transport that reads the learner's directory (``fs``) when an actor's node does not see it, and for one
    that needs every actor on the learner's host (``shm``) when an actor is on another node."""
    import dataclasses

    from distrl.weights import transport

    learner = nodes["learner0"]
    other_hosts = sorted(role for role, node in nodes.items() if role.startswith("actor") and node != learner)
    apart = [role for role in other_hosts
             if not (views[nodes[role]].shares_run_dir and views[learner].shares_run_dir)]
    if cfg.weights_transport is None:
        shm = (not other_hosts and local_model is not None and cfg.finetune == "full"
               and transport("shm").has_room(weight_file_bytes(local_model)))
        return dataclasses.replace(cfg, weights_transport="zmq" if apart else "shm" if shm else "fs")
    if apart and transport(cfg.weights_transport).needs_shared_filesystem:
        where = ", ".join(f"{role} on {views[nodes[role]].ip}" for role in apart)
        raise PreflightError("--weights_transport", f"{cfg.weights_transport} reads learner0's weight directory "
                             f"on {views[learner].ip}, which {where} cannot see (no shared filesystem)",
                             "use --weights_transport zmq (the default when roles span nodes) or nccl, or leave "
                             "it unset (docs/multinode.md)")
    if other_hosts and transport(cfg.weights_transport).same_host_only:
        where = ", ".join(f"{role} on {views[nodes[role]].ip}" for role in other_hosts)
        raise PreflightError("--weights_transport", f"{cfg.weights_transport} copies weights through learner0's "
                             f"host memory on {views[learner].ip}, and {where} run on other nodes",
                             "use --weights_transport zmq or nccl across nodes (docs/weights.md)")
    return cfg


class ModelFiles:
    """A model directory of the driver's node in Ray's object store: relative path -> object refs of its
    bytes in chunks of :data:`CHUNK_BYTES` (the driver holds one chunk in memory at a time; the object store
    of the driver's node must hold the whole model, spilling to disk beyond its memory)."""

    def __init__(self, model_dir: str):
        import ray

        self.source, self.manifest = model_dir, model_manifest(model_dir)
        self.files: dict[str, list] = {}
        for rel in self.manifest or {}:
            with open(Path(model_dir) / rel, "rb") as f:
                self.files[rel] = [ray.put(chunk) for chunk in iter(lambda: f.read(CHUNK_BYTES), b"")]

    def here(self, run_dir: str | Path) -> str:
        """The model on the calling node: ``source`` when this node has it (same file names and sizes, e.g. an
        actor that Ray restarted on the driver's node after its own node was lost), else :meth:`local_dir`."""
        return self.source if model_manifest(self.source) == self.manifest else self.local_dir(run_dir)

    def local_dir(self, run_dir: str | Path) -> str:
        """The model on this node: written once under the run directory's path here (``source`` itself when
        it lies in the run directory, e.g. --model tiny's ``model/``, else ``<run_dir>/model``) via a temp
        directory and a rename, so two roles of one node write it once. Returns the directory."""
        import ray

        run_dir = Path(run_dir)
        target = Path(self.source) if Path(self.source).is_relative_to(run_dir) else run_dir / "model"
        if target.is_dir():
            return str(target)
        temp = target.with_name(f".{target.name}-{uuid.uuid4().hex[:8]}")
        for rel, chunks in self.files.items():
            (temp / rel).parent.mkdir(parents=True, exist_ok=True)
            with open(temp / rel, "wb") as f:
                for ref in chunks:
                    f.write(ray.get(ref))
        try:
            temp.rename(target)
        except OSError:  # another role of this node renamed its copy first
            import shutil

            shutil.rmtree(temp, ignore_errors=True)
        log.info("model %s received from the driver's node into %s", self.source, target)
        return str(target)


def role_outputs(name: str) -> list[str]:
    """The files role ``name`` writes that a user looks at, as globs relative to the run directory."""
    globs = [f"logs/{name}.log", f"roles/{name}.json", f"tb/{name}/*", f"tb/{name}gen/*"]
    return globs + (["eval.jsonl"] if name == "actor0" else [])


def read_outputs(run_dir: str | Path, globs: list[str], known: dict[str, int]) -> dict[str, tuple[int, bytes]]:
    """Called in a role: relative path -> (offset, bytes from there) of each file of ``globs`` under
    ``run_dir`` that grew past ``known[path]`` bytes (from 0 when unknown or shrunk)."""
    run_dir, out = Path(run_dir), {}
    for pattern in globs:
        for path in sorted(run_dir.glob(pattern)):
            rel, size = str(path.relative_to(run_dir)), path.stat().st_size
            offset = known.get(rel, 0) if known.get(rel, 0) <= size else 0
            if path.is_file() and size > offset:
                with open(path, "rb") as f:
                    f.seek(offset)
                    out[rel] = (offset, f.read(size - offset))
    return out


class Gatherer:
    """Copies the outputs of the roles on nodes that do not see the driver's run directory into it, with one
    small Ray task pinned to each such node (:func:`read_outputs`; it works after a role died, too).

    ``nodes``: node id -> the roles there. Each file is copied from where the last copy ended, so a
    periodic gather sends only what is new."""

    def __init__(self, run_dir: Path, nodes: dict[str, list[str]], every_s: float = 30.0):
        self.run_dir, self.every_s, self.last = run_dir, every_s, 0.0
        self.globs = {node: [g for role in roles for g in role_outputs(role)] for node, roles in nodes.items()}
        self.known: dict[str, dict[str, int]] = {node: {} for node in nodes}

    def maybe_gather(self) -> None:
        """:meth:`gather` if ``every_s`` seconds passed since the last one (the driver's watch loop calls it)."""
        import time

        if time.time() - self.last >= self.every_s:
            self.gather()

    def gather(self, timeout_s: float = 30.0) -> None:
        """One round over every node; a node that does not answer is skipped (what was copied stays)."""
        import time

        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.last = time.time()
        task = ray.remote(num_cpus=0)(read_outputs)
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}  # a lost node's outputs: what was copied
        refs = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                    str(self.run_dir), globs, self.known[node]) for node, globs in self.globs.items() if node in alive}
        for node, ref in refs.items():
            try:
                files = ray.get(ref, timeout=timeout_s)
            except Exception as exc:  # a node that is gone: what was copied before stays
                log.warning("could not gather the logs and events of node %s: %s", node[:12],
                            str(exc).splitlines()[0])
                continue
            for rel, (offset, data) in files.items():
                path = self.run_dir / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "r+b" if offset and path.exists() else "wb") as f:
                    f.seek(offset)
                    f.write(data)
                    f.truncate()
                self.known[node][rel] = offset + len(data)


def _receive(files: ModelFiles, run_dir: str) -> str:
    return files.local_dir(run_dir)


@dataclass
class NodePlan:
    """What the driver hands each role once the placement is known (:func:`plan_nodes`).

    ``cfg``: the run's config with its weight transport settled; ``role_cfg``: role -> its config (``host``:
    the address it binds); ``model_dirs``: role -> its base model: a directory, or for a role on a node that
    lacks it the :class:`ModelFiles` (the role calls :meth:`ModelFiles.here` where it runs); ``hosts``: role
    -> its node's address; ``dist_address``: the learners' process group (None: the driver's host);
    ``gatherer``: copies the outputs of roles on nodes without the driver's run directory (None: none such)."""

    cfg: object
    role_cfg: dict
    model_dirs: dict
    hosts: dict
    dist_address: str | None = None
    gatherer: Gatherer | None = None
    apart: dict = None  # role -> node id, for roles on nodes that do not see the driver's run directory
    keys: object = None  # distrl.core.security.RunKeys when the endpoints are authenticated (curve_keys), else None

    def where(self, role: str, fn, *args):
        """``fn(*args)`` run where role ``role``'s files are: here, or in a Ray task pinned to its node when that
        node does not see the driver's run directory (e.g. the buffer's segment log, learner 0's checkpoints)."""
        if not self.apart or role not in self.apart:
            return fn(*args)
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0)(fn).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.apart[role], soft=False))
        return ray.get(task.remote(*args), timeout=120)


def loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is a loopback address (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def curve_keys(cfg, hosts: dict[str, str]):
    """Fresh CURVE keys for the run (a distrl.core.security.RunKeys) when a role binds off loopback (``hosts``: role
    -> the address it binds) and --auth is on (the default); None otherwise: plain TCP."""
    from distrl.core.security import RunKeys

    if not getattr(cfg, "auth", True) or all(loopback(host) for host in hosts.values()):
        return None
    return RunKeys.make()


def plan_nodes(cfg, run_dir: Path, model_dir: str, placement) -> NodePlan:
    """The plan for ``placement`` (a distrl.cmd.placement.Placement with ``nodes`` and ``home``). On one node:
    nothing changes but an unset transport (``fs``). Across nodes: probe them, settle the transport
    (:func:`settle_transport`, may raise PreflightError), bind each role on its node's address, ship the
    model to nodes that lack it, gather outputs from nodes that do not see the run directory. On any node: keys
    for the endpoints when a role binds off loopback (:func:`curve_keys`). Rewrites ``<run_dir>/config.json``
    with the settled config (never the keys)."""
    import dataclasses

    import ray

    nodes, roles = placement.nodes, list(placement.nodes)
    if not spans_nodes(nodes, placement.home):
        cfg = settle_transport(cfg, nodes, {}, local_model=model_dir)
        (run_dir / "config.json").write_text(cfg.to_json())
        hosts = dict.fromkeys(roles, cfg.host)
        return NodePlan(cfg, dict.fromkeys(roles, cfg), dict.fromkeys(roles, model_dir), hosts,
                        keys=curve_keys(cfg, hosts))
    views = probe_nodes(set(nodes.values()) | {placement.home}, run_dir, model_dir)
    cfg = settle_transport(cfg, nodes, views, local_model=model_dir if nodes["learner0"] == placement.home else None)
    learner = views[nodes["learner0"]]
    from distrl.weights import transport

    if transport(cfg.weights_transport).needs_broadcast_port:  # its group meets on learner 0's node
        cfg = dataclasses.replace(cfg, weights_broadcast_port=learner.ports[1])
    (run_dir / "config.json").write_text(cfg.to_json())
    model_dirs, shipped, received = dict.fromkeys(roles, model_dir), None, {}
    for role in roles:
        node = nodes[role]
        if role == "buffer0" or views[node].has_model:
            continue
        if node not in received:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            shipped = shipped or ModelFiles(model_dir)
            task = ray.remote(num_cpus=0)(_receive).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            received[node] = ray.get(task.remote(shipped, str(run_dir)))
            log.info("model %s shipped to node %s: %s", model_dir, views[node].ip, received[node])
        model_dirs[role] = shipped  # the role finds it on its node (ModelFiles.here), wherever Ray restarts it
    apart: dict[str, list[str]] = {}
    for role in roles:
        if not views[nodes[role]].shares_run_dir:
            apart.setdefault(nodes[role], []).append(role)
    hosts = {r: views[nodes[r]].ip for r in roles}
    return NodePlan(cfg, {r: dataclasses.replace(cfg, host=views[nodes[r]].ip) for r in roles}, model_dirs,
                    hosts, f"tcp://{learner.ip}:{learner.ports[0]}", Gatherer(run_dir, apart) if apart else None,
                    {r: node for node, rs in apart.items() for r in rs}, curve_keys(cfg, hosts))
