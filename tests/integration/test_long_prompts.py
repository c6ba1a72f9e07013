"""--long_prompts through `distrl train`: MATH-500 with the Qwen2.5 tokenizer and a --max_model_len that
many templated prompts exceed (100 - 8 new tokens leaves 92 prompt tokens; about 40 % of MATH-500's
prompts are longer as templated)."""

from __future__ import annotations

import json
import subprocess

import pytest

from distrl.buffer.segments import read_segments
from distrl.rollout.prompt_fit import prompt_ids
from distrl.rollout.tasks import load_task
from tests.helpers import shared_data
from tests.integration.test_train import ENV, ROOT, distrl, run, scalars

MATH500 = shared_data() / "math500" / "test.jsonl"
LIMIT = 92  # --max_model_len 100 - --max_new_tokens 8
EVAL_SIZE = 8  # held-out problems of --eval_every (seed 0): some are long


def flags(model, policy: str, name: str) -> list[str]:
    return distrl("--model", str(model), "--dataset", str(MATH500), "--engine", "hf", "--backend", "hf",
                  "--max_steps", "2", "--batch_size", "4", "--group_size", "2", "--max_new_tokens", "8",
                  "--max_model_len", "100", "--torch_threads", "1", "--no_console", "--long_prompts", policy,
                  "--eval_every", "2", "--eval_size", str(EVAL_SIZE), "--run_name", name)


def long_prompts_met(model, actor_id: int, groups: int) -> tuple[int, set[str], set[str], int]:
    """Walk actor `actor_id`'s prompt stream (seed 0) as far as its `groups` fitting prompts:
    (long prompts met on the way, prompt ids of the fitting ones, prompt ids of the long ones, long
    held-out problems)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    task = load_task(None, str(MATH500))
    heldout = task.heldout(EVAL_SIZE, 0)  # left out of every actor's stream
    fitting, long, met = set(), set(), 0
    stream = task.problems(seed=actor_id)  # the actor's seed: --seed 0 * 1000 + actor_id
    while groups:
        problem = next(stream)
        if len(prompt_ids(task, problem, tokenizer)[1]) > LIMIT:
            met += 1
            long.add(problem.prompt_id)
        else:
            fitting.add(problem.prompt_id)
            groups -= 1
    heldout_long = sum(len(prompt_ids(task, p, tokenizer)[1]) > LIMIT for p in heldout)
    return met, fitting, long, heldout_long


def test_long_prompts_are_skipped_and_counted(qwen_tiny, tmp_path):
    run(flags(qwen_tiny, "skip", "skip"), tmp_path)
    run_dir = tmp_path / "skip"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 2
    actor = summary["actors"][0]
    met, fitting, long, heldout_long = long_prompts_met(qwen_tiny, 0, actor["groups"])
    assert 0 < heldout_long < EVAL_SIZE
    assert met > 0 and actor["long_prompts_skipped"] == met == summary["long_prompts_skipped"]
    rows = read_segments(run_dir).to_pylist()
    assert rows and all(len(r["prompt_ids"]) <= LIMIT for r in rows)
    assert {r["prompt_id"] for r in rows} <= fitting and not {r["prompt_id"] for r in rows} & long
    counted = scalars(run_dir, "actor0", "rollout/long_prompts_skipped")  # stepped by policy version
    assert max(counted.values()) == met
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals and all(e["num_problems"] == EVAL_SIZE - heldout_long for e in evals)  # long ones left out


# slow: truncation to the last ids is tests/unit/test_prompt_fit.py::test_policies_skip_truncate_error, and the
# actor's long-prompt path through `distrl train` runs in make test as test_long_prompts_are_skipped_and_counted.
@pytest.mark.slow
def test_long_prompts_truncated_keep_their_last_tokens(qwen_tiny, tmp_path):
    from transformers import AutoTokenizer

    run(flags(qwen_tiny, "truncate", "cut"), tmp_path)
    run_dir = tmp_path / "cut"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 2 and summary["long_prompts_skipped"] == 0
    header = AutoTokenizer.from_pretrained(str(qwen_tiny))("<|im_start|>assistant\n")["input_ids"]
    rows = read_segments(run_dir).to_pylist()
    assert all(len(r["prompt_ids"]) <= LIMIT and r["prompt_ids"][-len(header):] == header for r in rows)
    cut = [r for r in rows if not r["prompt_text"].startswith("<|im_start|>system")]  # lost their start
    assert cut and all(len(r["prompt_ids"]) == LIMIT for r in cut)
    assert max(scalars(run_dir, "actor0", "rollout/long_prompts_truncated").values()) > 0


def test_long_prompts_error_refuses_before_anything_starts(qwen_tiny, tmp_path):
    proc = subprocess.run(flags(qwen_tiny, "error", "refused") + ["--log_dir", str(tmp_path)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("distrl train: error: "))
    assert lines[at].startswith("distrl train: error: --max_model_len: ") and "of the 500 prompts" in lines[at]
    assert lines[at + 1] == "  fix: raise --max_model_len to 832, or pass --long_prompts skip"
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_engines_generate_from_token_ids_as_from_the_text(kind, tmp_path, monkeypatch):
    """The actor hands engines the prompt's token ids (so a truncated prompt is exactly its kept ids):
    the same ids and the same seeded completions as the text they encode."""
    from distrl.core.tiny import build_tiny_model
    from distrl.rollout.engines import make_engine
    from distrl.rollout.engines.base import encode_prompt

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process vLLM-CPU
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = make_engine(kind, str(build_tiny_model(tmp_path / "tiny")), max_model_len=64)
    prompts = ["1+2=", "12*3="]
    ids = [encode_prompt(engine.tokenizer, p) for p in prompts]
    from_text, from_ids = (engine.generate(p, 2, 1.0, 6, seed=5) for p in (prompts, ids))
    assert [r.prompt_ids for r in from_text] == ids == [r.prompt_ids for r in from_ids]
    assert [[c.token_ids for c in r.completions] for r in from_text] == \
        [[c.token_ids for c in r.completions] for r in from_ids]
    assert engine.max_model_len == 64
    engine.close()
