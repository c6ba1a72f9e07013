"""The rollout's config section: the task (prompts, reward, held-out set) and how actors generate.

Torch-free, owned by the rollout. ``TaskOptions`` is read by every generator: the actors, a learner
with --learner_generates and the warm start; ``RolloutOptions`` only by actors. ``distrl/cmd/config.py``
composes them with the foundation's sections (``distrl/core/run_options.py``). Each section's ``check``
raises ValueError naming the first bad flag and never changes the config; ``resolve`` computes its
derived values at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

TASKS = ("arith", "gsm8k", "math500", "half_vocab")
BUILTIN_ENVS = ("calculator", "python")  # distrl/rollout/envs/



def check_reward_spec(spec: str, flag: str = "--reward") -> tuple[str, str]:
    """Split --reward `module:function` or `path/file.py:function` into (module or file, function name); the
    same for --env's `module:Class` (``flag``).

    Checks the form, that a file exists, or that a module can be found (without running it).
    Raises ValueError naming ``flag`` otherwise.
    """
    import importlib.util

    module, sep, func = spec.rpartition(":")
    if not sep or not module or not func.isidentifier():
        what = "function" if flag == "--reward" else "Class"
        raise ValueError(f"{flag} must be module:{what} or path/to/file.py:{what}, got {spec!r}")
    if module.endswith(".py"):
        if not Path(module).expanduser().is_file():
            raise ValueError(f"{flag} {spec}: no such file {module}")
        return module, func
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # a parent package that does not import
        raise ValueError(f"{flag} {spec}: cannot find module {module} ({exc})") from exc
    if found is None:
        raise ValueError(f"{flag} {spec}: no module named {module!r} (is it on PYTHONPATH? or give a "
                         f"path/to/file.py:{func})")
    return module, func


def template_is_file(value: str) -> bool:
    """Whether --prompt_template names an existing file (a long template text is not a path)."""
    try:
        return Path(value).expanduser().is_file()
    except OSError:  # e.g. a name too long for the filesystem
        return False


def read_prompt_template(value: str) -> str:
    """The --prompt_template text: the file's contents when ``value`` names a file, else ``value`` itself.

    Raises ValueError naming the flag when the text has no ``{question}``.
    """
    is_file = template_is_file(value)
    text = Path(value).expanduser().read_text() if is_file else value
    if "{question}" not in text:
        where = f"file {value}" if is_file else f"{value!r} (not a file either)"
        raise ValueError(f"--prompt_template must contain {{question}} where the problem goes; {where} has none")
    return text


@dataclass
class PromptOptions:
    """Where the problems come from and how each becomes a prompt: read by every generator (actors,
    --learner_generates, the warm start) and by `distrl eval`."""

    dataset: Optional[str] = None
    """Hub id (e.g. `openai/gsm8k`) or a local .jsonl/.json/.parquet file; refused with a built-in task
    (`arith`, `half_vocab`: they make their own problems; `distrl eval` without one takes the built-in task's
    held-out problems)."""
    task: Optional[Literal["arith", "gsm8k", "math500", "half_vocab"]] = None
    """Task (prompt template + reward): arith, gsm8k, math500, half_vocab. Default: inferred from the
    dataset's fields or name, `arith` when no dataset is given."""
    prompt_template: Optional[str] = None
    """The prompt text, with `{question}` where the problem goes (every `{question}` is replaced; other
    braces are kept, so `\\boxed{}` needs no escaping), or a file holding it. With a chat template it is
    the user turn (after the task's system prompt); without, the whole prompt. Unset: the task's own."""
    chat_template: Literal["auto", "on", "off"] = "auto"
    """`auto`: wrap the prompt in the tokenizer's chat template when it has one; `on`: always (an error at
    actor start if the tokenizer has none); `off`: plain text, never the chat template."""
    arith_ops: str = "+-"
    """`arith` task only: the operators its problems draw from, any of `+ - *` written together (e.g. `+`
    for two-number addition only, as `make demo` uses)."""
    arith_max_operand: int = 99
    """`arith` task only: operands are integers in [0, arith_max_operand]."""

    def resolve(self) -> None:
        """A --prompt_template file becomes an absolute path, so that roles started elsewhere (Ray workers,
        another directory) find it."""
        if self.prompt_template is not None and template_is_file(self.prompt_template):
            self.prompt_template = str(Path(self.prompt_template).expanduser().resolve())

    def check(self) -> None:
        """Raise ValueError naming the first bad prompt option."""
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.prompt_template is not None:
            read_prompt_template(self.prompt_template)
        if self.chat_template not in ("auto", "on", "off"):
            raise ValueError(f"--chat_template must be one of auto, on, off, got {self.chat_template!r}")
        if not self.arith_ops or set(self.arith_ops) - set("+-*"):
            raise ValueError(f"--arith_ops must be made of + - * (e.g. '+' or '+-'), got {self.arith_ops!r}")
        if self.arith_max_operand < 1:
            raise ValueError(f"--arith_max_operand must be >= 1, got {self.arith_max_operand}")


@dataclass
class TaskOptions:
    """How a generator's completions are batched and scored, long prompts treated and held-out problems set
    aside: read by actors, --learner_generates and the warm start (with PromptOptions)."""

    reward: Optional[str] = None
    """Your own reward instead of the task's: `module:function` (importable) or `path/to/file.py:function`.
    Called as `function(completion_text: str, problem: distrl.rollout.tasks.Problem) -> float | (float, dict[str,
    float])` (reward, named components); the task still gives prompts and gold answers (`problem.gold`).
    Each actor imports it and calls it once on its first problem at start: a missing module or function,
    an exception or a wrong return type stops the run there. See docs/users.md."""
    reward_timeout_s: Optional[float] = 10.0
    """Seconds one call of the --reward function may take: it runs in child processes of each actor
    (--reward_workers of them; JSON lines, nothing pickled), one killed and restarted past the limit, and
    that completion scores 0 with component `timeout` 1. `None` calls it in the actor's own process, one
    completion at a time, unbounded."""
    reward_workers: Optional[int] = None
    """Child processes of each actor that score a hand-back's completions in parallel: math_verify's checks
    (gsm8k, math500) and the --reward function (with --reward_timeout_s set). Unset: half the host's cores,
    1 to 8. Scoring runs between the engine's decode steps: 256 GSM8K completions took 0.4 s one by one."""
    async_scoring: int = 0
    """Groups whose rewards an actor may still be computing while its engine decodes on. 0: each hand-back is
    scored before the engine goes on, so a slow reward holds up every group behind it. N > 0: threads of the
    actor score each group (up to 16 at once) and each group is PUT as soon as its rewards are in, so a slow
    one arrives later, with an older policy version (dropped past --max_staleness), as slow verifiers, sandboxes
    or judges make it in real asynchronous runs; with N groups awaiting rewards the actor waits for the oldest
    (distrl/rollout/scoring.py). A resumed actor may generate again a group that was awaiting its rewards."""
    long_prompts: Literal["skip", "truncate", "error"] = "skip"
    """Prompts longer, as templated (chat template included), than --max_model_len minus --max_new_tokens
    tokens: `skip` never generates for them and counts them (TensorBoard `rollout/long_prompts_skipped`,
    summary `long_prompts_skipped`); `truncate` keeps their last tokens (the question's end and the
    assistant header the model answers after); `error` refuses the run at start, naming how many
    (distrl/rollout/prompt_fit.py)."""
    eval_every: Optional[int] = None
    """Policy versions between evaluations on a held-out set (unset or 0: no evaluation). Actor 0 evaluates
    with its own engine at version 0, at every multiple of N it serves, and at the final version; it
    writes `eval/<metric>` to tb/actor0 (step = version) and one line per evaluation to
    `<run_dir>/eval.jsonl`. The held-out problems are never trained on. Actor 0 generates no training
    data while it evaluates, and an evaluation counts against --heartbeat_timeout_s (docs/eval.md). With --env
    each held-out sample is a whole episode through the environment, scored by its final reward."""
    eval_size: int = 64
    """Held-out problems (with --eval_every): a seeded set of expressions for arith, a seeded choice of
    dataset rows otherwise; every actor leaves them out of its training stream."""
    batching: Literal["continuous", "static"] = "continuous"
    """How the HF engine (--engine hf, --learner_generates) batches the completions of one generate call:
    `continuous` keeps --max_num_seqs of them decoding and gives a finished one's slot (stop token or
    --max_new_tokens) to a waiting one at once; `static` runs batches of --max_num_seqs, each to its
    longest completion. Same tokens and logprobs (greedy: identical); either way a group is scored and
    PUT as soon as its last completion ends. `static` is kept as the reference and for comparison
    (bench/real_workload.py). vLLM always batches continuously (its own scheduler)."""
    max_num_seqs: Optional[int] = None
    """Most completions an actor's engine decodes at once: the HF engine's slots (unset: every completion
    of a generate call), vLLM's max_num_seqs (unset: vLLM's default)."""
    env: Optional[str] = None
    """Multi-turn episodes with an environment instead of single completions (docs/environments.md): a built-in
    (`calculator`: the model writes `<calc>EXPR</calc>`, the value comes back; `python`: a ```python block runs in
    a sandbox, its output comes back; refused, exit 2, where the sandbox does not work) or your own class,
    `module:Class` or `path/to/file.py:Class`, with `reset(problem) -> first observation` and
    `step(model_text) -> (observation | None, reward, done, info)`. It runs in child processes of each actor (one
    per live episode; JSON lines, nothing pickled); a crash or a timeout ends that episode only (TensorBoard
    `actor/env_errors`). The episode's reward is the environment's final reward (the task's reward and
    --reward are not used)."""
    env_max_turns: int = 4
    """--env: most model turns per episode; an episode still running after them ends, cut (finish_reason
    `length`, TensorBoard `actor/env_cut`), with the reward of its last step."""
    env_timeout_s: float = 10.0
    """--env: seconds one reset or step call may take; past it the environment's process is killed and the
    episode ends with an error (`actor/env_errors`)."""
    env_max_tokens: Optional[int] = None
    """--env: most completion tokens per episode, the model's and the observations' (each model turn gets at most
    --max_new_tokens of them); an episode that reaches it or --max_model_len ends, cut (`actor/env_cut`).
    Unset: --max_model_len only."""

    def resolve(self) -> None:
        """A --reward or --env file becomes an absolute path, so that roles started elsewhere (Ray workers,
        another directory) find it; raises ValueError on a bad --reward or --env."""
        if self.reward is not None:
            module, func = check_reward_spec(self.reward)
            if module.endswith(".py"):
                self.reward = f"{Path(module).expanduser().resolve()}:{func}"
        if self.env is not None and self.env not in BUILTIN_ENVS:
            module, name = check_reward_spec(self.env, "--env")
            if module.endswith(".py"):
                self.env = f"{Path(module).expanduser().resolve()}:{name}"

    def check(self) -> None:
        """Raise ValueError naming the first bad task option (the --reward module is imported by the actors,
        not here)."""
        if self.reward is not None:
            check_reward_spec(self.reward)
        if self.reward_timeout_s is not None and not self.reward_timeout_s > 0:
            raise ValueError(f"--reward_timeout_s must be > 0 or None, got {self.reward_timeout_s}")
        if self.reward_workers is not None and self.reward_workers < 1:
            raise ValueError(f"--reward_workers must be >= 1 (unset: half the cores, 1 to 8), "
                             f"got {self.reward_workers}")
        if self.async_scoring < 0:
            raise ValueError(f"--async_scoring must be >= 0 (0: score before decoding on), got {self.async_scoring}")
        if self.long_prompts not in ("skip", "truncate", "error"):
            raise ValueError(f"--long_prompts must be one of skip, truncate, error, got {self.long_prompts!r}")
        if self.eval_every is not None and self.eval_every < 0:
            raise ValueError(f"--eval_every must be >= 0 (0 or unset: no evaluation), got {self.eval_every}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"--batching must be continuous or static, got {self.batching!r}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"--max_num_seqs must be >= 1 or unset, got {self.max_num_seqs}")
        if self.eval_size < 1:
            raise ValueError(f"--eval_size must be >= 1, got {self.eval_size}")
        self._check_env()

    def _check_env(self) -> None:
        if self.env is None:
            return
        if self.env not in BUILTIN_ENVS:
            check_reward_spec(self.env, "--env")
        if self.env_max_turns < 1:
            raise ValueError(f"--env_max_turns must be >= 1, got {self.env_max_turns}")
        if not self.env_timeout_s > 0:
            raise ValueError(f"--env_timeout_s must be > 0, got {self.env_timeout_s}")
        if self.env_max_tokens is not None and self.env_max_tokens < 1:
            raise ValueError(f"--env_max_tokens must be >= 1 or unset, got {self.env_max_tokens}")


@dataclass
class RolloutOptions:
    """What only rollout actors read: the engine, how it loads weights, samples and evaluations it logs."""

    engine: Literal["vllm", "hf"] = "vllm"
    """Rollout generation engine: `vllm` (vLLM's offline LLM, in-process) or `hf` (transformers with a KV
    cache, for machines without vLLM, or models vLLM-CPU cannot run, e.g. attention head size < 32)."""
    inflight_update: Literal["off", "finish", "abort"] = "off"
    """A version announced while an actor generates: `off` loads it after the call; `finish` loads it
    between decode steps and the running completions go on with it (both versions are recorded);
    `abort` drops the call and generates again with it. `finish` and `abort` need --engine hf."""
    merge_lora: bool = False
    """Actors load each LoRA version merged into the base weights (W + B A alpha/r) and reloaded as full
    weights, instead of as an adapter: for engines without LoRA support."""
    log_samples: int = 2
    """Completions (prompt, completion, reward) actor 0 logs per policy version to TensorBoard's Text tab
    (`actor/samples`); 0 logs none."""
    eval_num_samples: int = 1
    """Completions per held-out problem at each evaluation (pass@k and maj@k for k up to it)."""
    eval_temperature: float = 0.0
    """Sampling temperature of evaluations; 0 is greedy (then --eval_num_samples must be 1)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of the GPU's memory an actor's vLLM engine takes (weights, activations and its KV cache; --engine
    vllm on CUDA). vLLM takes it whole at start: when the learner shares the actor's GPU (`distrl learn`
    and `distrl rollout` on one GPU), lower it so that the learner's step fits beside it, e.g. 0.3."""

    def check(self) -> None:
        """Raise ValueError naming the first bad actor option."""
        if self.inflight_update != "off" and self.engine != "hf":
            raise ValueError(f"--inflight_update {self.inflight_update} needs --engine hf (vLLM's offline "
                             "engine generates in one call)")
        if self.log_samples < 0:
            raise ValueError(f"--log_samples must be >= 0, got {self.log_samples}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.eval_num_samples < 1:
            raise ValueError(f"--eval_num_samples must be >= 1, got {self.eval_num_samples}")
        if self.eval_temperature < 0:
            raise ValueError(f"--eval_temperature must be >= 0, got {self.eval_temperature}")
        if self.eval_temperature == 0 and self.eval_num_samples > 1:
            raise ValueError(f"--eval_num_samples {self.eval_num_samples} with --eval_temperature 0 samples the "
                             "same greedy completion each time: give --eval_temperature > 0")
