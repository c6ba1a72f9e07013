"""`distrl eval`: evaluate a model, or a version a run published, on a dataset; print a table, write JSON.

The metrics (pass@k, maj@k, by group) and :func:`distrl.rollout.evaluation.evaluate_engine`, which samples with any
rollout engine and scores with the task's reward, live with the rollout role (``distrl/rollout/evaluation.py``);
training actor 0 runs the same code every ``--eval_every`` versions.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from distrl.rollout.evaluation import EvalReport, evaluate_engine


def adapter_format(path: str | Path) -> tuple[int, str]:
    """``(version, format)`` of a published version directory: ``lora`` when it holds an
    ``adapter_config.json``, else ``full``; the version is NNNN of a ``vNNNN`` name, else 1.

    Raises:
        FileNotFoundError: `path` is not a directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"--adapter {path}: no such directory (expected <run_dir>/weights/vNNNNNN)")
    version = int(path.name[1:]) if path.name[:1] == "v" and path.name[1:].isdigit() else 1
    return max(version, 1), "lora" if (path / "adapter_config.json").is_file() else "full"


def load_problems(task, cfg) -> list:
    """The problems `distrl eval` evaluates: the first --limit dataset rows in file order, or for a
    built-in task its held-out set of --limit (default 100) problems."""
    rows = getattr(task, "rows", None)
    if rows is None:
        return task.heldout(cfg.limit or 100, cfg.seed)
    count = len(rows) if cfg.limit is None else min(cfg.limit, len(rows))
    return [task.to_problem(rows[i], i) for i in range(count)]


def run(cfg) -> EvalReport:
    """`distrl eval`: evaluate --model (with --adapter's weights) on --dataset; print a table, write --output."""
    import tempfile

    from distrl.cmd.assemble import resolve_model, use_cpu_engine_env
    from distrl.rollout.engines import make_engine
    from distrl.rollout.tasks import load_task

    task = load_task(cfg.task, cfg.dataset, seed=cfg.seed, split=cfg.split, arith_ops=tuple(cfg.arith_ops),
                     arith_max_operand=cfg.arith_max_operand)
    task.set_prompt(cfg.prompt_template, cfg.chat_template)
    problems = load_problems(task, cfg)
    with tempfile.TemporaryDirectory(prefix="distrl-eval-") as tmp:
        model_dir = resolve_model(cfg.model, tmp, cfg.seed)
        check_fits(model_dir, cfg.tokenizer, task, problems, cfg.max_new_tokens, cfg.max_model_len)
        lora_rank = 16
        if cfg.adapter is not None:
            version, fmt = adapter_format(cfg.adapter)
            if fmt == "lora":
                lora_rank = json.loads((Path(cfg.adapter) / "adapter_config.json").read_text()).get("r", 16)
        use_cpu_engine_env(0)
        engine = make_engine(cfg.engine, model_dir, cfg.tokenizer, cfg.dtype, lora_rank, cfg.max_model_len,
                             seed=cfg.seed)
        if cfg.adapter is not None:
            engine.load_weights(version, fmt, cfg.adapter)
        t0 = time.perf_counter()
        report = evaluate_engine(engine, task, problems, num_samples=cfg.num_samples,
                                 temperature=cfg.sampling_temperature, max_new_tokens=cfg.max_new_tokens,
                                 seed=cfg.seed, ks=cfg.ks)
        engine.close()
    report.settings.update(model=cfg.model, adapter=cfg.adapter, dataset=cfg.dataset, task=task.name,
                           engine=cfg.engine, eval_s=time.perf_counter() - t0)
    print_report(report, title=f"distrl eval: {task.name}, {len(problems)} problems x {cfg.num_samples} samples")
    if cfg.output is not None:
        Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output).write_text(json.dumps(report.to_dict(), indent=1))
        print(f"wrote {cfg.output}")
    return report


def check_fits(model_dir: str, tokenizer: str | None, task, problems: list, max_new_tokens: int,
               max_model_len: int | None) -> None:
    """Before any engine starts: exit with a message naming the flag when the tokenizer does not match
    the model (more token ids than embeddings); raise PreflightError (``--max_model_len``, how many) when
    a prompt of `problems`, as templated (:func:`distrl.rollout.prompt_fit.prompt_ids`, chat template included),
    plus `max_new_tokens` exceeds the context (`--max_model_len`, else the model's ``max_position_embeddings``)."""
    from transformers import AutoConfig, AutoTokenizer

    from distrl.rollout.prompt_fit import measure, prompt_limit, refuse

    config = AutoConfig.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(tokenizer or model_dir)
    if len(tok) > config.vocab_size:
        raise SystemExit(f"distrl eval: error: the tokenizer{f' --tokenizer {tokenizer}' if tokenizer else ''} has "
                         f"{len(tok)} tokens but the model embeds only {config.vocab_size}: they do not match")
    limit = prompt_limit(max_model_len, max_new_tokens, getattr(config, "max_position_embeddings", None))
    refuse(measure(task, problems, tok, limit, policy="error"), max_new_tokens, can_skip=False)


def print_report(report: EvalReport, title: str = "distrl eval") -> None:
    """Print the metrics, and the per-group metrics when there are groups, as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{title}[/bold] (policy version {report.version})")
    table = Table()
    for name in ("metric", "value"):
        table.add_column(name)
    for name, value in report.metrics.items():
        table.add_row(name, f"{value:.0f}" if name.startswith("num_") else f"{value:.4f}")
    console.print(table)
    if report.by_group:
        k = max(report.settings.get("ks") or [1])
        columns = ["num_problems", "accuracy", f"pass@{k}", f"maj@{k}", "mean_length"]
        groups = Table(title="by group (n: problems, length: mean completion tokens)")
        groups.add_column("group", no_wrap=True)
        for name in columns:
            groups.add_column({"num_problems": "n", "mean_length": "length"}.get(name, name), justify="right",
                              no_wrap=True)
        for group, metrics in report.by_group.items():
            groups.add_row(group, *(f"{metrics[m]:.0f}" if m.startswith("num_") else f"{metrics[m]:.3f}"
                                    for m in columns))
        console.print(groups)
