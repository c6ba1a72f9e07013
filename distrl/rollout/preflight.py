"""A rollout actor's preflight: what it needs, checked before any engine, Ray or run directory exists.

The model and tokenizer resolve (`distrl.core.hub`), the dataset opens and its rows have the fields the
task needs (its first row only, as :func:`distrl.rollout.tasks.first_rows` reads it), the sampling temperature
is one the engine uses as given, and the prompts fit the context (`distrl/rollout/prompt_fit.py`, under
``--long_prompts``). Each failure is a :class:`distrl.core.errors.PreflightError` naming the flag;
`distrl/cmd/preflight.py` composes these per command, docs/troubleshooting.md lists them.
"""

from __future__ import annotations

from pathlib import Path

from distrl.core.errors import PreflightError
from distrl.core.hub import check_model, check_tokenizer, check_vocab_fits, looks_like_path
from distrl.core.run_options import SharedOptions
from distrl.rollout.config import PromptOptions, RolloutOptions, TaskOptions
from distrl.rollout.prompt_fit import PromptSource

# vLLM raises a temperature in (0, 0.01) to 0.01 (vllm.sampling_params._MAX_TEMP, with a warning), while
# the learner divides its logits by the configured one: the importance ratio would compare two policies.
VLLM_MIN_TEMPERATURE = 0.01


def check_sources(model: str, tokenizer: str | None) -> None:
    """`--model` and `--tokenizer` resolve (local, or hub ids, cached when offline) and fit each other."""
    check_model(model)
    check_tokenizer(tokenizer)
    check_vocab_fits(model, tokenizer)


def check_dataset(task: str | None, dataset: str | None) -> None:
    """`--dataset` exists and its first row has the fields of `task` (--task, else inferred from the row).

    A built-in task with a --dataset is refused (it would not read it); hub ids and dataset folders are left
    to `datasets` at start.
    """
    from distrl.rollout.tasks import BUILTIN_TASKS, DATASET_TASKS, LOCAL_BUILDERS, first_rows, infer_task

    if dataset is None:
        return
    if task in BUILTIN_TASKS:
        raise PreflightError("--dataset", f"task {task} makes its own problems and would not read {dataset}",
                             "drop --dataset, or give --task gsm8k or math500 (or no --task) to train on the file")
    path = Path(dataset).expanduser()
    if not path.exists() and (path.suffix in LOCAL_BUILDERS or looks_like_path(dataset)):
        raise PreflightError("--dataset", f"{dataset}: no such file",
                             "give an existing .jsonl, .json or .parquet file, or a hub id such as openai/gsm8k")
    if path.is_file() and path.suffix not in LOCAL_BUILDERS:
        raise PreflightError("--dataset", f"{dataset}: not a .jsonl, .json or .parquet file",
                             "convert it to JSON lines (one problem per line) or parquet")
    try:
        rows = first_rows(dataset)
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PreflightError("--dataset", f"{dataset}: cannot be read ({reason})",
                             "give a valid .jsonl (one JSON object per line), .json or .parquet file") from None
    if rows is None:
        return
    if not rows:
        raise PreflightError("--dataset", f"{dataset}: no rows", "give a file with at least one problem")
    have = sorted(rows[0])
    name = task or infer_task(rows, dataset)
    if name is None:
        raise PreflightError("--dataset", f"{dataset}: columns {have} match no task",
                             "gsm8k needs question + answer (with ####), math500 needs problem + answer: rename "
                             "the columns, or pass --task")
    missing = DATASET_TASKS[name].missing_fields(rows[0])
    if missing:
        needs = DATASET_TASKS[name].missing_fields({})
        raise PreflightError("--dataset", f"{dataset}: columns {have}, but task {name} needs {needs}",
                             f"give the rows the columns {missing} (rename or add them), or pass the --task "
                             "that fits the file")


def check_temperature(engine: str, temperature: float, eval_temperature: float = 0.0) -> None:
    """With vLLM, a temperature in (0, VLLM_MIN_TEMPERATURE) is refused (0, greedy, is allowed)."""
    if engine != "vllm":
        return
    if 0 < temperature < VLLM_MIN_TEMPERATURE:
        raise PreflightError("--temperature", f"{temperature:g} is below vLLM's floor of {VLLM_MIN_TEMPERATURE}",
                             f"use --temperature >= {VLLM_MIN_TEMPERATURE} (vLLM would raise it, the learner "
                             "would not), or --engine hf")
    if 0 < eval_temperature < VLLM_MIN_TEMPERATURE:
        raise PreflightError("--eval_temperature", f"{eval_temperature:g} is below vLLM's floor of "
                             f"{VLLM_MIN_TEMPERATURE}", "use 0 (greedy) or a value >= "
                             f"{VLLM_MIN_TEMPERATURE}, or --engine hf")


def check_prompts(source: PromptSource) -> None:
    """The task loads (a hub dataset: from the hub, or its cache when offline) and its prompts, as
    templated, fit the context under ``--long_prompts`` (:func:`distrl.rollout.prompt_fit.check_prompt_lengths`)."""
    from distrl.rollout.prompt_fit import check_prompt_lengths
    from distrl.rollout.tasks import DEFAULT_DATASETS, load_task

    prompt = source.prompt
    try:
        task = load_task(prompt.task, prompt.dataset, seed=source.seed, split=source.split,
                         arith_ops=tuple(prompt.arith_ops), arith_max_operand=prompt.arith_max_operand)
    except (OSError, ValueError) as exc:  # what `datasets` raises: offline, no such hub dataset, a bad file
        dataset = prompt.dataset or DEFAULT_DATASETS.get(prompt.task)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PreflightError("--dataset", f"{dataset}: cannot be loaded ({reason})",
                             "check the hub id (with HF_DATASETS_OFFLINE=1 it must be in the cache) or give a "
                             "local .jsonl or .parquet file") from None
    task.set_prompt(prompt.prompt_template, prompt.chat_template)
    check_prompt_lengths(source, task=task)


def check(prompt: PromptOptions, generation: TaskOptions, rollout: RolloutOptions, shared: SharedOptions) -> None:
    """`distrl rollout` (and the actors of `distrl train`): an actor's sections."""
    check_sources(shared.model, shared.tokenizer)
    check_inputs(prompt, generation, rollout, shared)


def check_inputs(prompt: PromptOptions, generation: TaskOptions, rollout: RolloutOptions,
                 shared: SharedOptions) -> None:
    """What an actor needs besides the model: the dataset and task, the temperatures, the prompts' length."""
    check_dataset(prompt.task, prompt.dataset)
    check_temperature(rollout.engine, shared.temperature, rollout.eval_temperature)
    check_env(generation.env)
    check_prompts(PromptSource.of_run(prompt, generation, shared))


def check_env(env: str | None) -> None:
    """`--env python`: its sandbox works here (:func:`distrl.rollout.envs.sandbox.probe` runs a trivial program
    in it); code is never run unsandboxed."""
    if env != "python":
        return
    from distrl.rollout.envs.sandbox import probe

    reason = probe()
    if reason is not None:
        raise PreflightError("--env", f"python: {reason}",
                             "run on Linux >= 5.13 with util-linux `unshare`, Landlock enabled and namespaces "
                             "allowed (as root, or with unprivileged user namespaces on), or use another --env")
