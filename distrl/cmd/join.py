"""Joining a running run (`distrl rollout --join`): the join file `distrl train` writes, and what a
joining actor makes of it.

The driver writes ``<run_dir>/join.json`` (:mod:`distrl.core.join`, mode 0600) once its learners' weight
endpoints are bound: the buffer and weight addresses, the weight transport, the rollout options of the run
(model, task, sampling: every `distrl rollout` flag `distrl train` also has) and, with CURVE on, the run's
client keys. ``distrl rollout --join <run dir or join file>`` takes the run's options as flags placed before
the command line's own (:func:`expand_join`, as a --config file's: a flag given on the command line, such
as a host-local --engine, --torch_threads or --weights_transport, wins), asks the buffer for a fresh actor
id (JOIN), loads the newest weights and asks for credits by the same rule as every actor. A run whose
version 0 is a directory that this host lacks is refused with what to pass (--model). ``nccl`` weights
cannot be joined (their group is fixed at start).
"""

from __future__ import annotations

import logging
from pathlib import Path

from distrl.cmd.compose import flat_fields
from distrl.cmd.configfile import flag_tokens
from distrl.core.join import join_file_path, read_join_file, write_join_file
from distrl.weights import transport

log = logging.getLogger("distrl.cmd.join")
NOT_JOINED = frozenset({"actor_id", "run_name", "log_dir", "resume", "config", "join"})  # host-local or per actor


def train_join_info(cfg, run_dir: Path, model_dir: str, endpoints, keys, flags: list[str]) -> dict:
    """The join file of a `distrl train` run (``cfg`` a TrainConfig, ``endpoints`` the actors'
    distrl.rollout.actor.ActorEndpoints, ``keys`` its distrl.core.security.RunKeys or None, ``flags``: the options of
    `distrl rollout`, i.e. RolloutConfig's fields)."""
    config = {name: getattr(cfg, name) for name in flags if hasattr(cfg, name) and name not in NOT_JOINED}
    tiny = cfg.model == "tiny" and not (run_dir / "warm_start" / "config.json").is_file()
    # tiny: every host builds the same model from --seed; else version 0 is model_dir (a hub id or a directory)
    config["model"] = "tiny" if tiny else (str(Path(model_dir).resolve()) if Path(model_dir).exists() else model_dir)
    config.update(buffer_address=endpoints.buffer, weights_pub=endpoints.weights_pub,
                  weights_endpoint=endpoints.weights_latest)
    info = {"run_dir": str(run_dir), "first_id": cfg.number_of_actors, "config": config}
    if keys is not None:
        info["keys"] = {"buffer": keys.buffer[0].decode(), "weights": keys.weights[0].decode(),
                        "client": [k.decode() for k in keys.client]}
    return info


def write_train_join_file(cfg, run_dir: Path, model_dir: str, endpoints, keys, flags: list[str]) -> None:
    """Write the run's join file (:func:`train_join_info`) and log how to use it."""
    path = write_join_file(run_dir, train_join_info(cfg, run_dir, model_dir, endpoints, keys, flags))
    log.info("join file %s: `distrl rollout --join %s` adds an actor to this run", path, run_dir)


def expand_join(argv: list[str], config_class: type) -> list[str]:
    """``argv`` (``[command, flags...]``) with the run's options from the join file of its last ``--join``
    inserted after the command `rollout` (``config_class``: its RolloutConfig), so that the command line's
    own flags, and a --config file's, win. Other commands, and a join file that cannot be read (the config
    then refuses --join with the reason), are left alone."""
    if not argv or argv[0] != "rollout":
        return argv
    where = None
    for i, token in enumerate(argv[1:], start=1):
        if token == "--join" and i + 1 < len(argv):
            where = argv[i + 1]
        elif token.startswith("--join="):
            where = token.split("=", 1)[1]
    if where is None or where == "None":
        return argv
    try:
        options = read_join_file(where)["config"]
    except ValueError:
        return argv
    names = {f.name for f in flat_fields(config_class)} - NOT_JOINED
    return [argv[0], *flag_tokens({k: v for k, v in options.items() if k in names}, config_class, where), *argv[1:]]


def apply_join(cfg) -> None:
    """Check ``cfg`` (a RolloutConfig with ``join`` set, its options from the join file already: `distrl
    rollout` expands them into flags, :func:`expand_join`) before its own resolve: the run directory is the
    run's when this host has it; nccl and a model directory this host lacks are refused. Raises ValueError
    naming what to pass."""
    info = read_join_file(cfg.join)
    cfg.join = str(join_file_path(cfg.join))
    defaults = {f.name: f.default for f in flat_fields(cfg)}
    run_dir = Path(info.get("run_dir", "joined"))
    if not cfg.run_name:  # the run's own directory when it is here (shared or the same host), else a local one
        if cfg.log_dir == defaults["log_dir"] and run_dir.is_dir():
            cfg.log_dir = str(run_dir.parent)
        cfg.run_name = run_dir.name
    if transport(cfg.weights_transport).needs_actors:  # nccl
        raise ValueError(f"--join {cfg.join}: this run's weights travel by {cfg.weights_transport}, whose group is "
                         "fixed when the run starts: a joining actor cannot enter it (start the run with "
                         "--weights_transport zmq)")
    model = str(cfg.model)
    if Path(model).is_absolute() and not Path(model).exists():
        raise ValueError(f"--join {cfg.join}: the run's model {model} is not on this host (no shared filesystem): "
                         f"pass --model with a copy of that directory here, or the hub id it came from; add "
                         f"--weights_transport zmq if the run's weight directory is not shared either")


def join_keys(join: str):
    """The run's CURVE keys from the join file (a distrl.core.security.RunKeys holding only what a client needs),
    or None when the run is plain TCP."""
    from distrl.core.security import RunKeys

    keys = read_join_file(join).get("keys")
    if keys is None:
        return None
    return RunKeys(buffer=(keys["buffer"].encode(), b""), weights=(keys["weights"].encode(), b""),
                   client=tuple(k.encode() for k in keys["client"]))


def join_actor_id(cfg) -> int:
    """A fresh actor id from the run's buffer (JOIN); raises TimeoutError if the buffer does not answer."""
    from distrl.core.buffer_client import BufferClient

    first_id = int(read_join_file(cfg.join).get("first_id", 0))
    with BufferClient(cfg.buffer_address, "joiner", timeout_s=10.0, retries=2,
                      curve_server_key=cfg.buffer_curve_server_key,
                      curve_client_key=cfg.buffer_curve_client_key) as client:
        return client.join(first_id)


def joined_actors(buffer_address: str) -> list[str]:
    """The actors that joined the run and spoke to the buffer lately (its STATS ``joined_actors``); [] when
    the buffer does not answer within a few seconds."""
    from distrl.core.buffer_client import BufferClient

    try:
        with BufferClient(buffer_address, "driver", timeout_s=5.0, retries=0) as client:
            return list(client.stats().get("joined_actors", []))
    except (TimeoutError, RuntimeError):
        return []
