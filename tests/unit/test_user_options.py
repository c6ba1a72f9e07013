"""Users' options: --reward (a function in a test file), --prompt_template / --chat_template,
--truncation (actor reward and learner mask), the final export, and the actor's sample text."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from distrl.cmd.assemble import learner_sections
from distrl.cmd.config import TrainConfig
from distrl.rollout.rewards import MathVerifier, UserReward, apply_truncation, timed_out
from distrl.rollout.rollouts import samples_markdown
from distrl.rollout.tasks import ArithTask, Problem
from tests.helpers import make_group, new_buffer, shared_data

REWARDS = Path(__file__).with_name("user_rewards.py")
SLOW_START = Path(__file__).with_name("slow_start_reward.py")
PROBLEM = Problem("arith:2+3=", "2+3=", "5", {"a": 2, "b": 3, "op": "+"})


# ---- --reward ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("timeout_s", [None, 10.0])
def test_user_reward_from_a_file(timeout_s):
    reward = UserReward(f"{REWARDS}:digits", timeout_s)
    try:
        reward.check(PROBLEM)
        # "5 ok": 1 digit of 4 characters; the gold "5" appears
        assert reward("5 ok", [1, 2], PROBLEM) == (0.25, {"digits": 0.25, "has_gold": 1.0})
        assert reward("", [], PROBLEM) == (0.0, {"digits": 0.0, "has_gold": 0.0})
    finally:
        reward.close()
    assert UserReward(f"{REWARDS}:constant", None)("x", [], PROBLEM) == (0.5, {})


def test_user_reward_by_module_name():
    reward = UserReward("tests.unit.user_rewards:constant", None)
    assert reward("x", [], PROBLEM) == (0.5, {})


@pytest.mark.parametrize("timeout_s", [None, 10.0])
@pytest.mark.parametrize("name, message", [("wrong_type", r"must return a finite float .* got 'high' \(str\)"),
                                           ("raises", "raised KeyError: 'no such field'")])
def test_bad_user_reward_fails_at_check_naming_the_flag(name, message, timeout_s):
    reward = UserReward(f"{REWARDS}:{name}", timeout_s)
    with pytest.raises(ValueError, match=f"--reward .*{message}"):
        reward.check(PROBLEM)
    reward.close()


@pytest.mark.parametrize("spec, message", [
    (f"{REWARDS}:missing", "has no function 'missing'"),
    ("tests/unit/nope.py:f", "no such file"),
    ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
    ("just_a_name", "must be module:function"),
])
def test_reward_spec_errors_at_config_or_import(spec, message):
    with pytest.raises(ValueError, match=f"--reward.*{message}"):
        UserReward(spec)
    if "missing" not in spec:  # the config catches all but a missing function (that needs the import)
        with pytest.raises(ValueError, match=message):
            TrainConfig(reward=spec)


def test_user_reward_timeout_scores_zero_and_restarts():
    reward = UserReward(f"{REWARDS}:slow", timeout_s=1.0)
    try:
        assert reward("slow", [], PROBLEM) == (0.0, {"timeout": 1.0})
        assert reward("fast", [], PROBLEM) == (1.0, {})
    finally:
        reward.close()


def test_timeouts_of_a_user_reward_and_of_math_verify_are_counted():
    """Issue 40: a timed-out reward scored 0 silently; timed_out (what the actor adds to actor/reward_timeouts)
    counts them, through the real worker pools, whichever scorer timed out."""
    reward = UserReward(f"{REWARDS}:slow", timeout_s=1.0, workers=2)
    try:
        scored = reward.score_many([("slow", [], PROBLEM), ("fast", [], PROBLEM), ("slow", [], PROBLEM)])
        assert scored == [(0.0, {"timeout": 1.0}), (1.0, {}), (0.0, {"timeout": 1.0})] and timed_out(scored) == 2
    finally:
        reward.close()
    verifier = MathVerifier(timeout_s=1.0)
    try:  # sympy does not return on this answer (tests/unit/test_tasks.py)
        scored = verifier.score_many(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{5}"], ["5", "5"])
        assert [r for r, _ in scored] == [0.0, 1.0] and timed_out(scored) == 1
    finally:
        verifier.close()
    assert timed_out([(1.0, {"timeout": 0.0}), (0.5, {})]) == 0


def test_a_check_after_a_timeout_gets_its_whole_limit_not_the_restart():
    """One worker: "slow" times out and its child is killed; the next check goes to a restarted child whose start
    (1.5 s: its import sleeps) is longer than the 1 s limit, and is answered: the limit counts from the send, after
    the restart. Charged with the restart, it scored 0 as a timeout (as the verifier's easy check did on a loaded
    machine in test_timeouts_of_a_user_reward_and_of_math_verify_are_counted)."""
    reward = UserReward(f"{SLOW_START}:slow", timeout_s=1.0, workers=1)
    try:
        assert reward.score_many([("slow", [], PROBLEM), ("fast", [], PROBLEM)]) == [(0.0, {"timeout": 1.0}),
                                                                                     (1.0, {})]
    finally:
        reward.close()


def test_user_reward_workers_score_a_list_in_parallel_in_order():
    """4 workers, 8 calls that sleep 0.5 or 0.6 s: answered in order by 4 distinct processes whose calls overlap in
    time (one by one, none would); a call over the limit scores 0 (its worker killed) while the others answer."""
    reward = UserReward(f"{REWARDS}:sleepy", timeout_s=3.0, workers=4)
    try:
        out = reward.score_many([(f"0.{5 + i % 2}", [], PROBLEM) for i in range(8)])
        assert [r for r, _ in out] == [0.5, 0.6] * 4
        assert len({c["pid"] for _, c in out}) == 4
        spans = sorted((c["start"], c["end"]) for _, c in out)
        assert sum(a[1] > b[0] for a, b in zip(spans, spans[1:])) >= 3, spans  # calls side by side
        out = reward.score_many([("0.1", [], PROBLEM), ("5", [], PROBLEM), ("0.2", [], PROBLEM)])
        assert [r for r, _ in out] == [0.1, 0.0, 0.2] and out[1][1] == {"timeout": 1.0}
        assert reward("0.3", [], PROBLEM)[0] == 0.3  # the killed worker restarts
    finally:
        reward.close()


def test_a_worker_that_exits_raises_and_leaves_no_stale_reply():
    """One of 3 workers exits mid-list: RuntimeError naming the worker; the other calls of that list are dropped with
    their workers, so the next list's replies are its own."""
    reward = UserReward(f"{REWARDS}:dies", timeout_s=5.0, workers=3)
    try:
        with pytest.raises(RuntimeError, match="worker exited with code 3"):
            reward.score_many([("ok", [], PROBLEM), ("die", [], PROBLEM), ("ok", [], PROBLEM)])
        assert reward.score_many([("okay", [], PROBLEM)] * 4) == [(4.0, {})] * 4  # not the dropped calls' 2.0
    finally:
        reward.close()


def test_reward_file_path_is_made_absolute_in_the_config():
    cfg = TrainConfig(reward=f"{os.path.relpath(REWARDS)}:digits")
    assert cfg.reward == f"{REWARDS}:digits"


# ---- --prompt_template, --chat_template ---------------------------------------------------------------------

def test_plain_template_replaces_question_and_keeps_other_braces():
    task = ArithTask()
    task.set_prompt("Solve {question} and put it in \\boxed{}. {question}")
    assert task.prompt(PROBLEM, None) == "Solve 2+3= and put it in \\boxed{}. 2+3="
    assert ArithTask().prompt(PROBLEM, None) == "2+3="  # the default is unchanged


def test_template_from_a_file(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("Q: {question}\nA:")
    task = ArithTask()
    task.set_prompt(str(path))
    assert task.prompt(PROBLEM, None) == "Q: 2+3=\nA:"
    assert TrainConfig(prompt_template=str(path)).prompt_template == str(path.resolve())


@pytest.mark.parametrize("value", ["no placeholder", "{questions}", "{ question }"])
def test_template_without_question_is_refused(value):
    with pytest.raises(ValueError, match=r"--prompt_template must contain \{question\}"):
        TrainConfig(prompt_template=value)
    with pytest.raises(ValueError, match="--prompt_template"):
        ArithTask().set_prompt(value)


def test_chat_template_modes_with_the_qwen_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(shared_data() / "tokenizers" / "qwen2.5"))
    task = ArithTask()
    task.set_prompt("Compute {question}", "auto")
    chat = task.prompt(PROBLEM, tok)
    assert "<|im_start|>user\nCompute 2+3=<|im_end|>\n" in chat and chat.endswith("<|im_start|>assistant\n")
    task.set_prompt("Compute {question}", "off")
    assert task.prompt(PROBLEM, tok) == "Compute 2+3="
    task.set_prompt(None, "off")
    assert task.prompt(PROBLEM, tok) == "2+3="


def test_chat_template_on_without_one_is_an_error():
    task = ArithTask()
    task.set_prompt(None, "on")
    with pytest.raises(ValueError, match="--chat_template on"):
        task.prompt(PROBLEM, None)
    with pytest.raises(ValueError, match="--chat_template must be"):
        task.set_prompt(None, "always")


# ---- --truncation -------------------------------------------------------------------------------------------

def test_apply_truncation_by_hand():
    comps = {"correct": 1.0}
    assert apply_truncation(1.0, comps, "stop", "zero") == (1.0, {"correct": 1.0, "truncated": 0.0})
    assert apply_truncation(1.0, comps, "length", "zero") == (0.0, {"correct": 1.0, "truncated": 1.0,
                                                                    "scored": 1.0})
    assert apply_truncation(0.7, comps, "length", "keep") == (0.7, {"correct": 1.0, "truncated": 1.0})
    assert apply_truncation(0.7, comps, "length", "mask") == (0.7, {"correct": 1.0, "truncated": 1.0})
    with pytest.raises(ValueError, match="--truncation"):
        apply_truncation(0.7, comps, "length", "drop")


def _with_truncated(table: pa.Table, truncated: set[int]) -> pa.Table:
    rows = table.to_pylist()
    for i in truncated:
        rows[i]["finish_reason"] = "length"
    from distrl.core.rows import table_from_rows

    return table_from_rows(rows)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from distrl.core.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("user") / "tiny", seed=0))


def _learner(tiny, **kw):
    from distrl.learn.learner import Learner

    cfg = TrainConfig(model=tiny, backend="hf", dtype="float32", learning_rate=1e-2, max_new_tokens=8, **kw)
    return Learner(*learner_sections(cfg), 0, 1, "tcp://127.0.0.1:9", tiny)


def _grads(lrn, table):
    norm, adv, _ = lrn.prepare(table)
    lrn.accumulate(table, adv, norm)
    out = [p.grad.clone() for p in lrn.params]
    lrn.optimizer.zero_grad(set_to_none=True)
    return out, norm


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean-token-mean"])
def test_mask_equals_training_without_the_truncated_rows(tiny, aggregation):
    """`mask` == the same batch with the truncated completions removed (advantages as computed over the
    whole group), for the token count and sequence count normalizers alike."""
    g = torch.Generator().manual_seed(0)
    table = pa.concat_tables([make_group(f"g{i}", rewards=torch.rand(4, generator=g).tolist()) for i in range(2)])
    table = _with_truncated(table, {1, 6})
    rows = table.to_pylist()
    masked = _learner(tiny, truncation="mask", loss_aggregation=aggregation, kl_coef=0.1)
    mask_grads, mask_norm = _grads(masked, table)
    kept = table.take([i for i in range(len(rows)) if i not in {1, 6}])
    plain = _learner(tiny, truncation="keep", loss_aggregation=aggregation, kl_coef=0.1)
    keep_grads, keep_norm = _grads(plain, kept)
    assert (mask_norm.num_tokens, mask_norm.num_sequences) == (keep_norm.num_tokens, keep_norm.num_sequences)
    assert mask_norm.num_sequences == 6
    for a, b in zip(mask_grads, keep_grads):
        torch.testing.assert_close(a, b)
    assert sum(float(a.abs().sum()) for a in mask_grads) > 0
    full_grads, _ = _grads(plain, table)  # `keep` trains on them: a different gradient
    assert any(not torch.allclose(a, b) for a, b in zip(full_grads, keep_grads))
    stats = masked.train_step(table)
    assert stats["learner/truncated_fraction"] == 2 / 8
    assert stats["learner/reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / 8)


def test_mask_with_every_completion_truncated_skips_the_step(tiny):
    table = _with_truncated(make_group("g0", rewards=[0.0, 1.0, 0.0, 1.0]), {0, 1, 2, 3})
    lrn = _learner(tiny, truncation="mask", kl_coef=0.1)
    stats = lrn.train_step(table)
    assert stats["learner/skipped_step"] == 1.0 and stats["learner/truncated_fraction"] == 1.0


# ---- final export ---------------------------------------------------------------------------------------------

def test_export_final_lora_merged_equals_base_plus_adapter(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distrl.learn.model import export_final

    lrn = _learner(tiny)
    g = torch.Generator().manual_seed(1)
    lrn.train_step(pa.concat_tables([make_group(f"g{i}", rewards=torch.rand(4, generator=g).tolist())
                                     for i in range(2)]))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = lrn.model(input_ids=ids).logits  # the learner's final policy, adapter on
    final = export_final(lrn.model, tmp_path / "final", tiny)
    assert sorted(p.name for p in final.iterdir()) == ["adapter", "merged"]
    merged = AutoModelForCausalLM.from_pretrained(str(final / "merged"), dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(str(final / "merged")).get_vocab() == \
        AutoTokenizer.from_pretrained(tiny).get_vocab()
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    by_hand = PeftModel.from_pretrained(base, str(final / "adapter")).merge_and_unload()
    reference = by_hand.state_dict()
    assert set(merged.state_dict()) == set(reference)
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    untrained = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()
    assert any(not torch.equal(t, untrained[n]) for n, t in merged.state_dict().items())
    export_final(merged, tmp_path / "final", tiny)  # a resumed run's export replaces the earlier one
    assert [p.name for p in final.iterdir()] == ["merged"] and not (tmp_path / "final.tmp").exists()


def test_export_final_full_finetuning_writes_merged_only(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from distrl.learn.model import export_final

    lrn = _learner(tiny, finetune="full")
    final = export_final(lrn.model, tmp_path / "final", tiny, merged=False)
    assert [p.name for p in final.iterdir()] == ["merged"]
    loaded = AutoModelForCausalLM.from_pretrained(str(final / "merged"), dtype=torch.float32).state_dict()
    for name, tensor in lrn.model.state_dict().items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def test_export_flag_checks():
    with pytest.raises(ValueError, match="--export_final adapter needs --finetune lora"):
        TrainConfig(export_final="adapter", finetune="full")
    with pytest.raises(ValueError, match="--log_samples"):
        TrainConfig(log_samples=-1)


# ---- sample completions --------------------------------------------------------------------------------------

def test_samples_markdown_takes_one_per_group_first():
    groups = [make_group("a", rewards=[0.25, 1, 0, 0]), make_group("b", rewards=[0.5, 0, 0, 0])]
    text = samples_markdown(groups, 3)
    assert text.count("**reward") == 3
    first, second, third = text.split("\n\n---\n\n")
    assert "**reward 0.250**" in first and "prompt `p-a`" in first and "    answer 0" in first
    assert "**reward 0.500**" in second and "prompt `p-b`" in second
    assert "**reward 1.000**" in third and "    answer 1" in third


# ---- the learner loop's monitoring, read back from its event file ----------------------------------------

def test_learner_run_logs_idle_throughput_staleness_and_exports(tiny, tmp_path):
    """Learner.run() against a real buffer (thread) with 4 groups of version 0 already PUT: versions 1 and 2
    train on staleness 0 and 1; the event file then holds the per-version idle fraction, tokens/s, the
    truncated fraction and the staleness histogram, and run() exported the final model."""
    import threading

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    from distrl.core.buffer_client import BufferClient
    from distrl.learn.learner import Learner
    from distrl.weights import DirectoryPublisher

    run_dir = tmp_path / "run"
    server = new_buffer(run_dir, batch_size=2, max_staleness=1, topk=4)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    publisher = DirectoryPublisher(run_dir / "weights")
    try:
        with BufferClient(server.address, "test", timeout_s=10.0) as c:
            g = torch.Generator().manual_seed(2)
            groups = [make_group(f"g{i}", rewards=torch.rand(4, generator=g).tolist()) for i in range(4)]
            c.put_many([_with_truncated(groups[0], {3})] + groups[1:])  # 1 of the 16 completions truncated
        cfg = TrainConfig(model=tiny, backend="hf", dtype="float32", max_steps=2, batch_size=2, group_size=4,
                          max_staleness=1, max_new_tokens=8, learning_rate=1e-2, truncation="mask")
        lrn = Learner(*learner_sections(cfg), 0, 1, server.address, tiny, publisher,
                      tb_dir=str(run_dir / "tb" / "learner0"), run_dir=run_dir)
        assert lrn.run()["version"] == 2
        lrn.close()
    finally:
        stop.set()
        thread.join(timeout=10)
        server.close()
        publisher.close()
    acc = EventAccumulator(str(run_dir / "tb" / "learner0"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    hist = {h.step: h.histogram_value for h in acc.Histograms("learner/staleness")}
    assert {s: (h.num, h.min, h.max) for s, h in hist.items()} == {1: (8, 0, 0), 2: (8, 1, 1)}
    scalar = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    for tag in ("learner/idle_fraction", "learner/idle_fraction_version"):
        assert sorted(scalar[tag]) == [1, 2] and all(0 <= v < 1 for v in scalar[tag].values()), tag
    assert all(v > 0 for v in scalar["learner/tokens_per_s_wall"].values())
    assert sum(scalar["learner/truncated_fraction"].values()) == pytest.approx(1 / 8)  # one row in 8 of one version
    merged = AutoModelForCausalLM.from_pretrained(str(run_dir / "final" / "merged"), dtype=torch.float32)
    assert merged.config.model_type == "qwen2" and (run_dir / "final" / "adapter" / "adapter_config.json").is_file()
