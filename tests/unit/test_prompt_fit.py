"""distrl.rollout.prompt_fit on real MATH-500 rows and the Qwen2.5 tokenizer: prompts measured as templated."""

from __future__ import annotations

from itertools import islice

import pytest

from distrl.core.errors import PreflightError
from distrl.rollout.prompt_fit import LongPrompts, PromptSource, check_prompt_lengths, measure, prompt_ids
from distrl.rollout.tasks import load_task
from tests.helpers import shared_data

MATH500 = shared_data() / "math500" / "test.jsonl"
QWEN = shared_data() / "tokenizers" / "qwen2.5"


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QWEN))


@pytest.fixture(scope="module")
def math500():
    task = load_task("math500", str(MATH500))
    return task, [task.to_problem(row, i) for i, row in enumerate(task.rows)]


def test_the_eval_check_counts_the_templated_prompt(qwen, math500, qwen_tiny):
    """On the row whose templated prompt is longest, a --max_model_len between its plain and its
    templated length (+ --max_new_tokens) is refused: the plain prompt would have fit."""
    from distrl.cmd.evaluate import check_fits

    task, problems = math500
    lengths = [len(prompt_ids(task, p, qwen)[1]) for p in problems]
    row = max(range(len(problems)), key=lengths.__getitem__)
    templated, plain = lengths[row], len(qwen(task.prompt(problems[row]))["input_ids"])  # 824, 810 tokens
    assert plain < templated
    model = str(qwen_tiny)  # tests/conftest.py: only its config and tokenizer are read here
    between = (plain + templated) // 2 + 16
    with pytest.raises(PreflightError, match=rf"--max_model_len: all 1 prompts .* \(up to {templated} tokens\)") as err:
        check_fits(model, None, task, [problems[row]], max_new_tokens=16, max_model_len=between)
    assert f"fix: raise --max_model_len to {templated + 16}" in str(err.value)
    assert "--long_prompts" not in str(err.value)  # distrl eval has no such flag
    check_fits(model, None, task, [problems[row]], max_new_tokens=16, max_model_len=templated + 16)


def test_measure_counts_prompts_over_the_limit(qwen, math500):
    task, problems = math500
    lengths = [len(prompt_ids(task, p, qwen)[1]) for p in problems]
    fit = measure(task, problems, qwen, 92)
    assert (fit.total, fit.long, fit.longest) == (500, sum(n > 92 for n in lengths), max(lengths))
    assert 0 < fit.long < 500
    assert measure(task, problems, qwen, None).long == 0  # no limit known: nothing is long


def test_policies_skip_truncate_error(qwen, math500):
    task, problems = math500
    long = next(p for p in problems if len(prompt_ids(task, p, qwen)[1]) > 92)
    short = next(p for p in problems if len(prompt_ids(task, p, qwen)[1]) <= 92)
    text, ids = prompt_ids(task, long, qwen)

    skip = LongPrompts(task, qwen, 92, "skip")
    assert not skip.fits(long) and skip.fits(short) and skip.skipped == 0  # fits() counts nothing
    assert skip.fit(long) is None and skip.fit(short) == prompt_ids(task, short, qwen)
    kept = list(skip.stream(iter([long, short, long, short])))
    assert [p for p, _, _ in kept] == [short, short] and skip.skipped == 3

    cut = LongPrompts(task, qwen, 92, "truncate")
    cut_text, cut_ids = cut.fit(long)
    assert cut_ids == ids[-92:] and cut.truncated == 1  # the end: question's last part, assistant header
    assert text.endswith(cut_text) and cut_text.endswith("<|im_start|>assistant\n")

    with pytest.raises(PreflightError, match="--max_model_len"):
        LongPrompts(task, qwen, 92, "error", max_new_tokens=8).fit(long)
    with pytest.raises(PreflightError, match="100 prompts in a row"):
        list(LongPrompts(task, qwen, 92, "skip").stream(iter([long] * 100), max_skips=100))


def test_check_prompt_lengths_per_policy(qwen_tiny):
    """Preflight: `error` names how many are long and both fixes; `skip` refuses only when none fits."""
    from distrl.cmd.config import TrainConfig

    def cfg(**kw):
        run = TrainConfig(model=str(qwen_tiny), dataset=str(MATH500), max_new_tokens=8, **kw)
        return PromptSource.of_run(run.prompt, run.generation, run.shared)

    fit = check_prompt_lengths(cfg(max_model_len=100))  # default skip
    assert fit.total == 500 and 0 < fit.long < 500 and fit.longest == 824 and fit.limit == 92
    with pytest.raises(PreflightError) as err:
        check_prompt_lengths(cfg(max_model_len=100, long_prompts="error"))
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"--max_model_len: {fit.long} of the 500 prompts")
    assert lines[1] == "  fix: raise --max_model_len to 832, or pass --long_prompts skip"
    with pytest.raises(PreflightError, match="all 500 prompts"):
        check_prompt_lengths(cfg(max_model_len=20))
    with pytest.raises(PreflightError, match="--max_new_tokens: 8 leaves no room"):
        check_prompt_lengths(cfg(max_model_len=8))
    assert check_prompt_lengths(cfg(max_model_len=832, long_prompts="error")).long == 0


def test_the_tiny_models_prompt_encoder_encodes_as_its_tokenizer():
    """`--model tiny`'s preflight measures with a PromptEncoder (no transformers import): the same ids
    as the model's transformers tokenizer, for arith prompts, GSM8K questions (characters outside the vocabulary
    included) and the empty text; no chat template."""
    from distrl.core.prompt_encoder import PromptEncoder
    from distrl.core.tiny import build_tokenizer
    from distrl.rollout.prompt_fit import load_tokenizer

    encoder, model_max = load_tokenizer("tiny")
    assert isinstance(encoder, PromptEncoder) and encoder.chat_template is None and model_max == 4096
    tokenizer = build_tokenizer()
    arith = load_task("arith", None, seed=0)
    gsm8k = load_task("gsm8k", str(shared_data() / "gsm8k" / "train.jsonl"), seed=0)
    texts = [arith.prompt(p, encoder) for p in islice(arith.problems(0), 20)]
    texts += [gsm8k.prompt(gsm8k.to_problem(gsm8k.rows[i], i), encoder) for i in range(20)] + ["", "é ü 😀 <calc>"]
    assert [encoder(t)["input_ids"] for t in texts] == [tokenizer(t)["input_ids"] for t in texts]
    assert len(encoder("1+2=")["input_ids"]) == 4


def test_a_saved_tokenizers_prompt_encoder_renders_and_encodes_as_transformers(qwen_tiny, math500, tmp_path):
    """A model directory with tokenizer.json (the Qwen2.5 tokenizer as save_pretrained writes it): the preflight's
    PromptEncoder renders the chat template to the same text and encodes it to the same ids as the transformers
    tokenizer, on every MATH-500 prompt and 100 GSM8K prompts; where the files cannot reproduce the tokenizer
    (no tokenizer.json; a config adding a BOS token) preflight takes transformers' tokenizer instead."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from distrl.core.prompt_encoder import PromptEncoder
    from distrl.rollout.prompt_fit import load_tokenizer

    encoder, model_max = load_tokenizer(str(qwen_tiny))
    assert isinstance(encoder, PromptEncoder) and encoder.chat_template and model_max == 4096
    assert encoder.special_tokens["eos_token"] == "<|im_end|>"
    tokenizer = AutoTokenizer.from_pretrained(str(qwen_tiny))
    task, problems = math500
    gsm8k = load_task("gsm8k", str(shared_data() / "gsm8k" / "train.jsonl"), seed=0)
    pairs = [(task, p) for p in problems] + [(gsm8k, gsm8k.to_problem(gsm8k.rows[i], i)) for i in range(100)]
    for t, problem in pairs:
        text = t.prompt(problem, encoder)
        assert text == t.prompt(problem, tokenizer) and "<|im_start|>assistant" in text
        assert encoder(text)["input_ids"] == tokenizer(text)["input_ids"], problem.prompt_id
    assert isinstance(load_tokenizer(str(QWEN))[0], type(tokenizer))  # vocab.json + merges.txt only
    bos = tmp_path / "bos"
    shutil.copytree(qwen_tiny, bos)
    config = json.loads((bos / "tokenizer_config.json").read_text())
    (bos / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert PromptEncoder.from_dir(bos) is None


def test_preflight_of_a_model_directory_imports_neither_torch_nor_transformers_tokenizers(qwen_tiny):
    """The driver's prompt-length check on a model directory (what `distrl train` runs before Ray starts) imports
    no torch: measured in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys; from distrl.cmd.config import TrainConfig; "
            "from distrl.rollout.prompt_fit import PromptSource, check_prompt_lengths; "
            f"run = TrainConfig(model={str(qwen_tiny)!r}, dataset={str(MATH500)!r}, max_new_tokens=8); "
            "fit = check_prompt_lengths(PromptSource.of_run(run.prompt, run.generation, run.shared)); "
            "print(fit.total, fit.longest, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["500", "824", "False"]


def test_a_repeated_launch_reads_the_prompt_lengths_from_the_cache(qwen_tiny, tmp_path):
    """The chat-templated lengths are cached under distrl's cache directory: a second preflight with the same inputs
    reads them without importing transformers (its renderer), a changed template or a damaged file measures anew.
    Each preflight in a fresh interpreter, as each `distrl train` runs it."""
    import os
    import subprocess
    import sys

    def preflight(template: str | None = None) -> list[str]:
        code = ("import sys; from distrl.cmd.config import TrainConfig; "
                "from distrl.rollout.prompt_fit import PromptSource, check_prompt_lengths; "
                f"run = TrainConfig(model={str(qwen_tiny)!r}, dataset={str(MATH500)!r}, max_new_tokens=8, "
                f"prompt_template={template!r}); "
                "fit = check_prompt_lengths(PromptSource.of_run(run.prompt, run.generation, run.shared)); "
                "print(fit.total, fit.longest, 'transformers' in sys.modules)")
        env = {**os.environ, "DISTRL_CACHE_DIR": str(tmp_path)}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env=env).stdout.split()

    assert preflight() == ["500", "824", "True"]  # measured: the chat template rendered by transformers
    (cached,) = (tmp_path / "prompt_lengths").iterdir()
    assert preflight() == ["500", "824", "False"]  # read back: no transformers import
    longer = preflight("Solve this problem step by step and box the answer.\n\n{question}")
    assert longer[0] == "500" and int(longer[1]) > 824 and longer[2] == "True"  # another key
    assert len(list((tmp_path / "prompt_lengths").iterdir())) == 2
    cached.write_text("[1, 2")  # damaged: measured again, and rewritten
    assert preflight() == ["500", "824", "True"] and preflight() == ["500", "824", "False"]
