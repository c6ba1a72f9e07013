"""--env (issue 44, acceptance 1, CPU): multi-turn episodes through the real actor step (HF engine in fp32, the
session's tiny Qwen2 with the Qwen2.5 tokenizer and its chat template, the in-process buffer, real environment
processes): one row per episode whose loss mask covers only the model's tokens and whose behavior logprobs equal a
recomputation of the whole sequence; an environment that blocks does not hold back the other episodes' PUTs; one
that crashes, hangs or raises ends only its episode (`actor/env_errors`). Also the calculator's safe evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distrl.buffer.inprocess import open_buffer
from distrl.buffer.segments import read_segments
from distrl.cmd.assemble import actor_sections, buffer_sections
from distrl.cmd.config import TrainConfig
from distrl.rollout.actor import ActorEndpoints, RolloutActor
from distrl.rollout.envs.calculator import Calculator, evaluate
from distrl.rollout.envs.episodes import ObservationFormat
from distrl.weights import DirectoryPublisher

SCRIPTS = Path(__file__).with_name("env_scripts.py")


class RecordingClient:
    """The in-process buffer's client, recording each PUT's groups in order; ``on_put`` runs after each PUT."""

    def __init__(self, client, on_put=None):
        self.client, self.on_put, self.puts = client, on_put, []

    def put_many(self, groups, *args, **kwargs):
        acks = self.client.put_many(groups, *args, **kwargs)
        self.puts += [g.to_pylist() for g in groups]
        if self.on_put is not None:
            self.on_put(self.puts)
        return acks

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.fixture
def make_actor(tmp_path, qwen_tiny, monkeypatch):
    monkeypatch.setenv("DISTRL_TEST_ENV_DIR", str(tmp_path))  # the environment processes inherit it
    made = []

    def make(env: str, on_put=None, **options):
        settings = dict(model=str(qwen_tiny), task="arith", engine="hf", backend="hf", dtype="float32", group_size=1,
                        batch_size=4, max_new_tokens=5, max_steps=1, run_name="t", log_dir=str(tmp_path),
                        attest_weights=False, weights_transport="fs", env=f"{SCRIPTS}:{env}", temperature=1.0,
                        learner="pg", pg_baseline="running_mean")
        cfg = TrainConfig(**{**settings, **options})
        cfg.validate()
        where = tmp_path / f"actor{len(made)}"
        buffer = open_buffer(*buffer_sections(cfg), where / "buffer")
        publisher = DirectoryPublisher(where / "weights")
        client = RecordingClient(buffer.client("actor0"), on_put)
        actor = RolloutActor(*actor_sections(cfg), 0, ActorEndpoints("in-process", *publisher.addresses),
                             str(qwen_tiny), work_dir=str(where), client=client)
        made.append((actor, publisher, buffer))
        actor.parts = dict(cfg=cfg, publisher=publisher, buffer=buffer)
        return actor

    yield make
    for actor, publisher, buffer in made:
        actor.close()
        publisher.close()
        buffer.close()


def learner_step(actor, model_dir: str, table) -> tuple[dict, dict]:
    """The real Learner's batch totals and one optimizer step on ``table`` (rows the actor PUT)."""
    from distrl.cmd.assemble import learner_sections
    from distrl.learn.learner import Learner

    parts = actor.parts
    learner = Learner(*learner_sections(parts["cfg"]), 0, 1, "in-process", model_dir, parts["publisher"],
                      client=parts["buffer"].client("learner0"))
    try:
        return learner.prepare(table)[2], learner.train_step(table)
    finally:
        learner.close()


def recompute_logprobs(model_dir: str, ids: list[int], temperature: float) -> torch.Tensor:
    """(len(ids) - 1,) logprob of each token given the ones before, under softmax(logits / T), fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def vllm_recompute(engine, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1,) vLLM's own logprob of each token given the ones before (prompt_logprobs, temperature 1)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0)
    [out] = engine.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return torch.tensor([lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])])


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_three_turn_episode_is_one_row_with_model_tokens_in_the_loss(make_actor, qwen_tiny, tmp_path, engine,
                                                                       monkeypatch):
    if engine == "vllm":
        pytest.importorskip("vllm")
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process engine (DESIGN.md)
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    actor = make_actor("Scripted", group_size=2, batch_size=2, engine=engine)
    stats = actor.step(2)
    assert stats["actor/env_errors"] == 0 and stats["actor/turns_mean"] == 3
    rows = read_segments(tmp_path / "actor0" / "buffer").to_pylist()
    assert len(rows) == 4  # one row per episode, two groups of two
    fmt = ObservationFormat(actor.engine.tokenizer, chat=True)
    stop_ids = {actor.engine.tokenizer.eos_token_id, *getattr(actor.engine, "stop_ids", torch.tensor([])).tolist()}
    assert fmt.pieces is not None  # the Qwen2.5 template's tool turn
    for row in rows:
        ids, mask, ends = row["completion_ids"], row["loss_mask"], row["turn_ends"]
        assert len(ends) == 3 and ends[-1] == len(ids) == len(mask) == len(row["behavior_logprobs"])
        assert row["reward"] == 1.0 and row["finish_reason"] == "stop"
        start = 0
        for turn, end in enumerate(ends):
            assert mask[start:end] == [1] * (end - start) and end > start  # the model's turn
            if turn < 2:  # then the observation, formatted and tokenized on its own, out of the loss
                stopped = ids[end - 1] if ids[end - 1] in stop_ids else None
                obs = fmt.ids(f"obs{turn + 1}", stopped)
                assert ids[end:end + len(obs)] == obs and mask[end:end + len(obs)] == [0] * len(obs)
                assert "<tool_response>" in actor.engine.tokenizer.decode(obs)
                start = end + len(obs)
        sequence = row["prompt_ids"] + ids
        if engine == "hf":
            recomputed = recompute_logprobs(str(qwen_tiny), sequence, row["temperature"])
        else:  # vLLM-CPU: against its own recomputation
            recomputed = vllm_recompute(actor.engine, sequence)
        recomputed = recomputed[len(row["prompt_ids"]) - 1:]
        model_tokens = torch.tensor(mask, dtype=torch.bool)
        behavior = torch.tensor(row["behavior_logprobs"])
        atol = 1e-5 if engine == "hf" else 1e-4
        torch.testing.assert_close(behavior[model_tokens], recomputed[model_tokens], atol=atol, rtol=0)
        assert (behavior[~model_tokens] == 0).all()
    if engine == "hf":  # the learner counts and trains the episodes' model tokens only
        totals, _ = learner_step(actor, str(qwen_tiny), read_segments(tmp_path / "actor0" / "buffer"))
        assert totals["tokens"] == sum(sum(r["loss_mask"]) for r in rows) < sum(len(r["loss_mask"]) for r in rows)


def test_vllm_and_the_hf_engine_play_equal_greedy_episodes(make_actor, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    episodes = {}
    for engine in ("hf", "vllm"):
        actor = make_actor("Scripted", engine=engine, max_new_tokens=4)
        problems, _, prompts = zip(*(next(actor.rollouts.problems) for _ in range(2)))  # the same stream each
        groups = actor.rollouts.episodes.run(list(problems), list(prompts), 1, 0.0)  # temperature 0: greedy
        episodes[engine] = sorted((i, result.completions[0]) for ended in groups for i, result in ended)
    assert len(episodes["hf"]) == 2
    for (i, hf), (j, vllm) in zip(episodes["hf"], episodes["vllm"], strict=True):
        assert i == j and len(hf.turn_ends) == 3 and hf.reward == 1.0
        for name in ("prompt_ids", "token_ids", "turn_ends", "loss_mask", "reward", "finish_reason"):
            assert getattr(hf, name) == getattr(vllm, name), name
        torch.testing.assert_close(torch.tensor(hf.logprobs), torch.tensor(vllm.logprobs), atol=1e-4, rtol=0)


def test_an_environment_that_blocks_does_not_delay_the_other_episodes_puts(make_actor, tmp_path):
    def release_after_the_others(puts):
        if len(puts) == 3:  # every other episode's group is in the buffer: let the blocked one go
            (tmp_path / "release").touch()

    actor = make_actor("BlockOne", on_put=release_after_the_others, env_timeout_s=120.0)
    actor.step(4)
    blocked = [group[0]["reward_components"] for group in actor.client.puts]
    assert len(blocked) == 4 and [dict(c)["blocked"] for c in blocked] == [0.0, 0.0, 0.0, 1.0]


def test_an_environment_that_crashes_hangs_or_raises_ends_only_its_episode(make_actor, tmp_path):
    actor = make_actor("Faulty", env_timeout_s=3.0, batch_size=5)
    stats = actor.step(5)
    assert stats["actor/env_errors"] == 3 and actor.rollouts.episodes.errors == 3
    rows = read_segments(tmp_path / "actor0" / "buffer").to_pylist()
    assert len(rows) == 5
    failed = [r for r in rows if r["finish_reason"] == "error"]
    assert len(failed) == 3 and all(set(r["loss_mask"]) == {0} and r["reward"] == 0 for r in failed)
    assert sorted(r["reward"] for r in rows if r["finish_reason"] != "error") == [1.0, 1.0]
    assert actor.step(2)["actor/env_errors"] == 3  # the actor goes on: new episodes in fresh processes
    table = read_segments(tmp_path / "actor0" / "buffer")  # 7 rows: the 3 errors' count no loss token
    totals, _ = learner_step(actor, actor.parts["cfg"].model, table)
    assert totals["tokens"] == sum(sum(r["loss_mask"]) for r in table.to_pylist() if r["finish_reason"] != "error") > 0


def test_the_calculator_evaluates_arithmetic_only():
    assert evaluate("12 * (3 + 4) - 5") == 79 and evaluate("7 / 2") == 3.5 and evaluate("-2 ** 3") == -8
    for bad in ("__import__('os').system('true')", "x + 1", "9 ** 9 ** 9", "1 / 0", "[1, 2]", "'a' * 3"):
        with pytest.raises(ValueError):
            evaluate(bad)
    env = Calculator()
    from distrl.rollout.rewards import Problem

    env.reset(Problem("p", "12*7", "84"))
    assert env.step("Let me compute <calc>12*7</calc>") == ("84", 0.0, False, {"calls": 1})
    assert env.step("<calc>import os</calc>")[0] == "error"
    observation, reward, done, _ = env.step("The answer is 84.")
    assert observation is None and done and reward == 1.0


def test_a_turn_is_cut_after_its_stop_string_and_observations_are_formatted():
    from transformers import AutoTokenizer

    from distrl.rollout.envs.episodes import cut_at_stop
    from tests.helpers import shared_data

    tok = AutoTokenizer.from_pretrained(shared_data() / "tokenizers" / "qwen2.5")
    ids = tok("I will compute <calc>12*7</calc> and then more words", add_special_tokens=False)["input_ids"]
    k = cut_at_stop(tok, ids, ("</calc>",))
    assert tok.decode(ids[:k]).endswith("</calc>") and "</calc>" not in tok.decode(ids[:k - 1])
    assert cut_at_stop(tok, ids, ("<nothing>",)) is None and cut_at_stop(tok, ids, ()) is None
    assert ObservationFormat(tok, chat=False).ids("84", None) == tok("84", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    after_stop = tok.decode(ObservationFormat(tok, chat=True).ids("84", end))
    assert after_stop == "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ObservationFormat(tok, chat=True).ids("84", None)).startswith("<|im_end|>\n<|im_start|>user")
