"""No option lost (issue 17, acceptance 4): each command's `--help` against the one of commit 944c626.

``options_944c626.json`` holds the option names each `distrl <command> --help` listed at 944c626 (how it
was made: its ``_source``). `distrl train`, `buffer`, `replay` and `eval` keep every one; `distrl learn` and
`distrl rollout` keep every one except those below, which that role never read (each still a flag of
`distrl train`, and a `--config` file shared between roles may still hold them: they are ignored there).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tyro

from distrl.cmd.cli import COMMANDS

OLD = json.loads((Path(__file__).parent / "options_944c626.json").read_text())

_TRAIN_ONLY = "read by `distrl train` alone (Ray, GPU placement, console, watchdog, its bind host)"
_WARM_START = "the warm start runs in `distrl train` before any role starts"
_BUFFER = "the buffer's selection and storage: `distrl buffer` takes them"
_ACTOR = "read by rollout actors only (the engine, in-flight updates, actor 0's samples and evaluations)"
_LEARNER = "read by learners only (loss, optimizer, model, checkpoints, export)"

# options neither role launcher reads: the driver's, the warm start's and the buffer's
_NOT_A_ROLE_OPTION = {
    **dict.fromkeys(["console", "heartbeat_timeout_s", "max_actor_restarts", "ray_address", "gpus_per_actor",
                     "gpus_per_learner", "gpu_split", "placement_strategy", "placement_timeout_s", "host"],
                    _TRAIN_ONLY),
    **dict.fromkeys(["warm_start_steps", "warm_start_lr", "warm_start_batch_size", "warm_start_until_accuracy"],
                    _WARM_START),
    **dict.fromkeys(["topk", "topk_by", "order", "filter_zero_variance", "replay_ratio", "fsync", "max_rows",
                     "max_bytes", "max_msg_bytes", "prefault_bytes", "dedup_window", "segment_max_bytes",
                     "retention_bytes", "retention_s"], _BUFFER),
}

REMOVED: dict[str, dict[str, str]] = {
    "learn": {
        **_NOT_A_ROLE_OPTION,
        # --learner_generates uses the learner's own model: no engine, no weight loading, never actor 0
        **dict.fromkeys(["engine", "inflight_update", "merge_lora", "log_samples", "eval_num_samples",
                         "eval_temperature"], _ACTOR),
    },
    "rollout": {
        **_NOT_A_ROLE_OPTION,
        "max_staleness": "the buffer enforces it and learner rank 0 keeps weights by it; an actor never reads it",
        "number_of_learners": "an actor asks for batch_size / number_of_actors groups; learners read it",
        "learner_generates": "a learner's option (it makes the learner generate too)",
        **dict.fromkeys(["max_steps", "learning_rate", "learner_chunk_size", "learner_pack_tokens",
                         "learner_head_chunk_tokens", "learner_head", "gradient_checkpointing", "learner_compile",
                         "clip_eps", "clip_eps_low", "clip_eps_high", "loss_aggregation", "loss_norm_tokens",
                         "pg_baseline", "baseline_decay", "kl_coef", "kl_estimator", "off_policy", "is_cap",
                         "is_level", "is_mask_low", "is_mask_high", "max_grad_norm", "lr_schedule", "lr_warmup_steps",
                         "lora_alpha", "lora_target_modules", "backend", "load_in_4bit",
                         "checkpoint_every", "export_final"], _LEARNER),
    },
}


def help_options(command: str, capsys, monkeypatch) -> set[str]:
    """The option names `distrl <command> --help` prints: each `--flag` that starts a row of a section's box
    (`--x, --no_x` gives x; wrapped descriptions are indented further); a positional argument (replay's SOURCE,
    shown as its type STR) is named ``source``."""
    monkeypatch.setenv("COLUMNS", "80")  # one column of sections (wider terminals put them side by side)
    configs = {name: cls for name, (cls, _) in COMMANDS.items()}
    with pytest.raises(SystemExit):
        tyro.extras.subcommand_cli_from_dict(configs, args=[command, "--help"], prog="distrl", use_underscores=True)
    names = set()
    for line in capsys.readouterr().out.splitlines():
        for cell in line.split("│") if "│" in line else [line[1:]]:  # boxes (a section each, side by side)
            # a flag's row: its type, `, --no_x` or its help follows (a section's description may start a line
            # with a flag too: `--learner_generates, the warm start`)
            found = re.match(r" (--[a-z0-9_]+(?=$| [A-Z{[]|, --no_|\s{2,})|[A-Z][A-Z_]+ )", cell)  # or plain text
            if found and found.group(1) != "--help":
                token = found.group(1).strip()
                names.add(token[2:] if token.startswith("--") else "source")
    return names


@pytest.mark.parametrize("command", ["train", "buffer", "replay", "eval"])
def test_these_commands_keep_every_option(command, capsys, monkeypatch):
    assert set(OLD[command]) - help_options(command, capsys, monkeypatch) == set()


@pytest.mark.parametrize("command", ["learn", "rollout"])
def test_roles_lose_only_the_options_they_never_read(command, capsys, monkeypatch):
    now, train = help_options(command, capsys, monkeypatch), help_options("train", capsys, monkeypatch)
    assert set(OLD[command]) - now == set(REMOVED[command])
    assert set(REMOVED[command]) <= train  # still a flag of the run, where it has an effect
    assert not set(REMOVED[command]) & now
