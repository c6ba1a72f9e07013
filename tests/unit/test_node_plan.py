"""The pure parts of `distrl train` across Ray nodes (distrl/cmd/nodes.py, the --*_resources flags):
which weight transport a placement gets, the refusal of `fs` across nodes, the resource flags' checks,
and the incremental copy of a role's outputs. tests/integration/test_multinode.py runs the whole."""

from __future__ import annotations

import pytest

from distrl.cmd.config import TrainConfig, ray_resources
from distrl.cmd.nodes import NodeView, model_manifest, read_outputs, settle_transport, spans_nodes
from distrl.core.errors import PreflightError


def view(node: str, ip: str, shares: bool) -> NodeView:
    return NodeView(node, ip, shares_run_dir=shares, has_model=True, ports=(1, 2))


NODES = {"buffer0": "a", "learner0": "a", "actor0": "b", "actor1": "a"}
APART = {"a": view("a", "10.0.0.1", True), "b": view("b", "10.0.0.2", False)}
SHARED = {"a": view("a", "10.0.0.1", True), "b": view("b", "10.0.0.2", True)}


def test_unset_transport_is_fs_on_one_node_or_a_shared_filesystem_else_zmq():
    one_node = {role: "a" for role in NODES}
    assert settle_transport(TrainConfig(), one_node, {}).weights_transport == "fs"
    assert settle_transport(TrainConfig(), NODES, SHARED).weights_transport == "fs"
    assert settle_transport(TrainConfig(), NODES, APART).weights_transport == "zmq"


def test_unset_transport_is_shm_for_full_weights_when_the_actors_share_this_node_and_dev_shm_has_room(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    (model / "config.json").write_text("{}")
    one_node = {role: "a" for role in NODES}
    full = TrainConfig(finetune="full")
    assert settle_transport(full, one_node, {}, local_model=str(model)).weights_transport == "shm"
    assert settle_transport(TrainConfig(), one_node, {}, local_model=str(model)).weights_transport == "fs"  # LoRA
    assert settle_transport(full, one_node, {}).weights_transport == "fs"  # learner 0 on another node
    assert settle_transport(full, NODES, SHARED, local_model=str(model)).weights_transport == "fs"  # actor0 apart
    (model / "model.safetensors").unlink()
    assert settle_transport(full, one_node, {}, local_model=str(model)).weights_transport == "fs"  # size unknown


def test_a_chosen_transport_is_kept_and_fs_across_nodes_refused():
    assert settle_transport(TrainConfig(weights_transport="zmq"), NODES, APART).weights_transport == "zmq"
    assert settle_transport(TrainConfig(weights_transport="fs"), NODES, SHARED).weights_transport == "fs"
    with pytest.raises(PreflightError) as err:
        settle_transport(TrainConfig(weights_transport="fs"), NODES, APART)
    problem = str(err.value).splitlines()[0]
    assert problem.startswith("--weights_transport: fs reads learner0's weight directory on 10.0.0.1")
    assert "actor0 on 10.0.0.2" in problem and "actor1" not in problem  # actor1 shares learner0's node


def test_shm_is_refused_when_an_actor_is_on_another_node_even_with_a_shared_filesystem():
    one_node = {role: "a" for role in NODES}
    full = dict(weights_transport="shm", finetune="full")
    assert settle_transport(TrainConfig(**full), one_node, {}).weights_transport == "shm"
    with pytest.raises(PreflightError) as err:
        settle_transport(TrainConfig(**full), NODES, SHARED)
    problem = str(err.value).splitlines()[0]
    assert problem.startswith("--weights_transport: shm copies weights through learner0's host memory on 10.0.0.1")
    assert "actor0 on 10.0.0.2" in problem and "actor1" not in problem


def test_spans_nodes_counts_the_driver():
    assert not spans_nodes({"buffer0": "a", "actor0": "a"}, "a")
    assert spans_nodes({"buffer0": "b", "actor0": "b"}, "a")  # every role elsewhere: the driver must reach them


def test_resource_flags_take_a_json_object_of_positive_amounts():
    assert ray_resources('{"node2": 1}', "--actor_resources") == {"node2": 1.0}
    assert ray_resources(None, "--actor_resources") == {}
    for bad in ("node2", "[1]", '{"node2": 0}', '{"node2": true}', '{"node2": "1"}'):
        with pytest.raises(ValueError, match="--learner_resources must be a JSON object"):
            TrainConfig(learner_resources=bad)
    with pytest.raises(ValueError, match="--buffer_resources: give GPUs with --gpus_per_actor"):
        TrainConfig(buffer_resources='{"GPU": 1}')


def test_outputs_are_copied_from_where_the_last_copy_ended(tmp_path):
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "actor0.log"
    log.write_bytes(b"first\n")
    globs = ["logs/actor0.log", "tb/actor0/*", "eval.jsonl"]
    assert read_outputs(tmp_path, globs, {}) == {"logs/actor0.log": (0, b"first\n")}
    assert read_outputs(tmp_path, globs, {"logs/actor0.log": 6}) == {}  # nothing new
    with open(log, "ab") as f:
        f.write(b"second\n")
    assert read_outputs(tmp_path, globs, {"logs/actor0.log": 6}) == {"logs/actor0.log": (6, b"second\n")}
    log.write_bytes(b"new\n")  # shorter than what was copied (a new file): copied whole again
    assert read_outputs(tmp_path, globs, {"logs/actor0.log": 13}) == {"logs/actor0.log": (0, b"new\n")}


def test_model_manifest_names_files_and_sizes(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub" / "w.bin").write_bytes(b"1234")
    assert model_manifest(str(tmp_path)) == {"config.json": 2, "sub/w.bin": 4}
    assert model_manifest("HuggingFaceTB/SmolLM2-135M") is None  # a hub id: each node loads it itself


def test_role_options_carry_the_bundle_and_pin_roles_without_one():
    from distrl.cmd.placement import Placement

    placement = Placement(0.0, 0.0, group=object(), bundles={"actor0": (1, {"CPU": 1.0, "node2": 1.0})}, home="ab" * 28)
    options = placement.options("actor0")
    assert (options["num_gpus"], options["num_cpus"], options["resources"]) == (0.0, 1.0, {"node2": 1.0})
    assert options["scheduling_strategy"].placement_group_bundle_index == 1
    assert placement.options("buffer0")["scheduling_strategy"].node_id == "ab" * 28  # no bundle: the driver's node
