"""`make demo-tools`' parts (bench/demo_tools.py, docs/environments.md "Warm start"), on the embedded tiny model:
the calculator's demonstrated episodes are trained on the model's tokens only (the observation's are inputs,
never targets); a short warm start through the command's own path (`distrl.cmd.warm_start.warm_start_run`, its
`--env` transcripts) makes a model that, played greedily by the real actor's episode loop and calculator
processes on held-out problems (`--eval_every` with `--env`), writes well-formed `<calc>a*b</calc>` calls and
answers with the calculator's value; the flags the demo needs validate, and those that cannot work are refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from distrl.cmd.config import TrainConfig
from distrl.core.tiny import build_tiny_model, build_tokenizer
from distrl.learn.sft import segments_batch
from distrl.rollout.envs.demonstrations import calculator_turns, demonstration_ids
from distrl.rollout.tasks import ArithTask

FLAGS = dict(model="tiny", task="arith", arith_ops="*", arith_max_operand=99, env="calculator", env_max_turns=3,
             engine="hf", backend="hf", finetune="full", dtype="float32", max_new_tokens=18, batch_size=4,
             group_size=2, max_steps=1, warm_start_steps=90, warm_start_lr=2e-3, warm_start_batch_size=64,
             eval_every=10, eval_size=16, attest_weights=False, weights_transport="fs", torch_threads=1)


def test_tiny_tokenizer_writes_calc_calls():
    tok = build_tokenizer()
    assert len(tok) == 52 and tok.convert_tokens_to_ids(["<", ">"]) == [50, 51]
    ids = tok("<calc>37*45</calc>", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == "<calc>37*45</calc>"


def test_demonstration_has_loss_on_model_tokens_only():
    tok = build_tokenizer()
    task = ArithTask(0, 99, ("*",))
    problem = next(p for p in task.problems(3) if p.meta["a"] >= 10 and p.meta["b"] >= 10)
    a, b, gold = problem.meta["a"], problem.meta["b"], problem.gold
    turns = calculator_turns(problem)
    assert turns == [f"<calc>{a}*{b}</calc>", gold, f"={gold}"]  # the observation is the calculator's own reply
    segments = demonstration_ids(turns, task.prompt(problem, tok), tok, chat=False)
    assert [m for _, m in segments] == [False, True, False, True]
    ids, mask, labels = segments_batch([segments], pad=tok.pad_token_id)
    prompt, call, observation, answer = (len(s) for s, _ in segments)
    assert prompt == len(f"{a}*{b}=") and call == len(turns[0]) and observation == answer - 2 == len(gold)
    row, lab = ids[0].tolist(), labels[0].tolist()
    assert tok.decode(row) == f"{a}*{b}=<calc>{a}*{b}</calc>{gold}={gold}<eos>" and mask[0].sum() == len(row)
    trained = [i for i, t in enumerate(lab) if t != -100]
    model_positions = list(range(prompt, prompt + call)) + list(range(len(row) - answer, len(row)))
    assert trained == model_positions  # the prompt and the observation's tokens: -100
    assert tok.decode([lab[i] for i in trained]) == f"<calc>{a}*{b}</calc>={gold}<eos>"


def test_warm_start_without_demonstrations_is_refused():
    with pytest.raises(ValueError, match="--warm_start_steps with --env python --task arith: no demonstrations"):
        TrainConfig(**{**FLAGS, "env": "python"}).validate()
    with pytest.raises(ValueError, match="--learner_generates makes single completions: not available with --env"):
        TrainConfig(**{**FLAGS, "learner_generates": True, "number_of_actors": 0}).validate()
    TrainConfig(**FLAGS).validate()  # --eval_every with --env is accepted


def test_a_users_environment_demonstrates_through_its_class():
    """A user's --env class with demonstrate(problem) is warm-started on it; one without is refused, naming it."""
    from distrl.rollout.envs.demonstrations import demonstrations

    slow = f"{Path(__file__).parents[1] / 'data' / 'slow_tool_env.py'}:SlowCalculator"
    TrainConfig(**{**FLAGS, "env": slow, "arith_ops": "+*"}).validate()  # not refused at start: asked at the warm start
    problem = next(ArithTask(0, 99, ("+", "*")).problems(1))
    assert demonstrations(slow, "arith")(problem) == calculator_turns(problem)
    scripted = f"{Path(__file__).with_name('env_scripts.py')}:Scripted"
    with pytest.raises(ValueError, match="may define demonstrate"):
        demonstrations(scripted, "arith")


@pytest.fixture(scope="module")
def warm_started(tmp_path_factory):
    """A tiny model warm-started for 90 steps (lr 2e-3) on calculator episodes by the command's own path."""
    from distrl.cmd.warm_start import warm_start_run

    where = tmp_path_factory.mktemp("demo_tools")
    cfg = TrainConfig(**FLAGS, log_dir=str(where), run_name="t")
    cfg.validate()
    base = build_tiny_model(where / "tiny", seed=0)
    return cfg, where, warm_start_run(cfg, where, str(base))


def test_warm_started_model_calls_the_calculator_on_held_out_problems(warm_started):
    from distrl.buffer.inprocess import open_buffer
    from distrl.cmd.assemble import actor_sections, buffer_sections
    from distrl.rollout.actor import ActorEndpoints, RolloutActor
    from distrl.rollout.evaluation import evaluate_episodes
    from distrl.weights import DirectoryPublisher

    cfg, where, model_dir = warm_started
    buffer = open_buffer(*buffer_sections(cfg), where / "buffer")
    publisher = DirectoryPublisher(where / "weights")
    actor = RolloutActor(*actor_sections(cfg), 0, ActorEndpoints("in-process", *publisher.addresses), model_dir,
                         work_dir=str(where), client=buffer.client("actor0"))
    try:
        assert actor.evaluator is not None and actor.evaluator.episodes is actor.rollouts.episodes
        problems = actor.evaluator.problems
        assert len(problems) == 16
        report = evaluate_episodes(actor.rollouts.episodes, actor.rollouts.task, problems)
        line = actor.evaluator.evaluate(actor.engine, actor.metrics)  # --eval_every's path: eval.jsonl
    finally:
        actor.close()
        publisher.close()
        buffer.close()
    calls = 0
    for problem, record in zip(problems, report.records):
        text = record.samples[0].text
        a, b = problem.meta["a"], problem.meta["b"]
        match = re.match(r"<calc>(\d+)\*(\d+)</calc>", text)
        calls += bool(match)
        if match and (int(match[1]), int(match[2])) == (a, b):  # a right call: the calculator's value follows it
            assert text.startswith(f"<calc>{a}*{b}</calc>{a * b}")
    assert calls >= 12, [r.samples[0].text for r in report.records]
    assert report.metrics["accuracy"] >= 0.5 and report.settings["env"] == "calculator"
    assert line["version"] == 0 and line["accuracy"] == report.metrics["accuracy"]  # greedy: the same episodes
    assert json.loads((where / "eval.jsonl").read_text().splitlines()[-1])["accuracy"] == line["accuracy"]
