"""The pure parts of weight attestation (distrl/weights/attest.py): the canary, stamps, the check, the stop rule,
and segment logs written before the stamp columns (read with null stamps)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from distrl.core.rows import COMPLETION_SCHEMA, LEGACY_SCHEMA, STAMP_COLUMNS, upgrade
from distrl.weights.attest import (
    CANARY_LENGTH,
    TOLERANCE_BF16,
    TOLERANCE_FP32,
    Attestor,
    Stamper,
    WrongWeightsError,
    canary_ids,
    tolerance,
)
from tests.helpers import make_group


def stamped(group_id: str, actor: int, versions: list[int], canaries: list[float], digest: str = "d") -> pa.Table:
    """A group of 4 rows whose stamp is ``versions`` / ``canaries`` (digest ``digest`` for each)."""
    table = make_group(group_id, policy_version=versions[0], actor_id=actor)
    n = table.num_rows
    table = table.set_column(table.schema.get_field_index("served_versions"), "served_versions",
                             pa.array([versions] * n, pa.list_(pa.int64())))
    table = table.set_column(table.schema.get_field_index("weights_digests"), "weights_digests",
                             pa.array([[digest] * len(versions)] * n, pa.list_(pa.string())))
    return table.set_column(table.schema.get_field_index("canary_logprobs"), "canary_logprobs",
                            pa.array([canaries] * n, pa.list_(pa.float64())))


def test_canary_ids_are_fixed_and_inside_small_vocabularies():
    ids = canary_ids(151_936)
    assert ids == canary_ids(151_936) and len(ids) == CANARY_LENGTH and max(ids) < 256
    assert max(canary_ids(50)) < 50


def test_tolerance_by_dtype_and_device():
    assert tolerance("torch.float32", "cpu") == TOLERANCE_FP32
    assert tolerance("torch.bfloat16", "cpu") == tolerance("torch.float32", "cuda") == TOLERANCE_BF16
    assert tolerance("torch.float32", "cpu", override=0.5) == 0.5


def test_stamper_computes_one_canary_per_version_and_lists_the_versions_of_a_call():
    calls = []
    stamper = Stamper(lambda: calls.append(1) or -4.0 - len(calls))
    stamper.start(0, "")
    stamper.served(1, "d1")  # an in-flight update
    stamper.served(1, "d1")
    assert stamper.fields() == {"served_versions": [0, 1], "weights_digests": ["", "d1"],
                                "canary_logprobs": [-5.0, -6.0]}
    stamper.start(1, "d1")
    assert stamper.fields()["served_versions"] == [1] and len(calls) == 2
    assert Stamper(lambda: 1 / 0, enabled=False).fields() == dict.fromkeys(STAMP_COLUMNS)


def test_a_group_whose_canary_differs_is_quarantined_the_others_kept():
    att = Attestor(tol=1e-4)
    att.record(0, -4.0)
    att.record(1, -4.01)
    table = pa.concat_tables([stamped("ok", 0, [1], [-4.01 + 5e-5]), stamped("bad", 1, [1], [-4.0]),
                              stamped("span", 0, [0, 1], [-4.0, -4.01])])
    verdict = att.check(table)
    assert verdict.quarantined == 1 and verdict.unattested == 0
    assert set(verdict.kept.column("group_id").to_pylist()) == {"ok", "span"}
    assert "group bad of actor 1 stamped version 1" in verdict.lines[0] and "tolerance 1e-04" in verdict.lines[0]


def test_a_published_digest_that_differs_quarantines_and_unknown_stamps_are_kept():
    att = Attestor(tol=1e-4)
    att.record(3, -4.0, digest="xxh3_128:aa")
    table = pa.concat_tables([stamped("other", 0, [3], [-4.0], digest="xxh3_128:bb"), stamped("old", 0, [2], [-9.0]),
                              make_group("unstamped"), stamped("shared", -1, [3], [-4.0], digest="")])
    verdict = att.check(table)  # "shared": --learner_generates samples the learner's own model, loads nothing
    assert verdict.quarantined == 1 and "digest" in verdict.lines[0]
    assert verdict.unattested == 2
    assert set(verdict.kept.column("group_id").to_pylist()) == {"old", "unstamped", "shared"}


def test_consecutive_versions_with_quarantined_groups_stop_the_run():
    att = Attestor(tol=1e-4, max_bad_versions=2)
    att.record(1, -4.0)
    att.check(stamped("bad", 1, [1], [-3.0]))
    att.judge(1, 1)
    att.judge(0, 2)  # a clean version ends the streak
    att.check(stamped("bad2", 1, [1], [-3.0]))
    att.judge(1, 3)
    with pytest.raises(WrongWeightsError, match=r"2 consecutive learner versions \[3, 4\].*actor 1 \(stamped"):
        att.judge(1, 4)
    Attestor(tol=1e-4, max_bad_versions=0).judge(5, 1)  # 0: never stops


def test_legacy_segment_batches_read_with_null_stamps():
    table = make_group("g")
    legacy = pa.RecordBatch.from_arrays([table.column(n).combine_chunks() for n in LEGACY_SCHEMA.names],
                                        schema=LEGACY_SCHEMA)
    upgraded = upgrade(legacy)
    assert upgraded.schema.equals(COMPLETION_SCHEMA)
    assert upgraded.column("served_versions").null_count == upgraded.num_rows
    assert Attestor(1e-4).check(pa.Table.from_batches([upgraded])).unattested == 1
