"""Multi-turn episodes over an engine, token in / token out: the loop of ``--env`` (:class:`EpisodeRunner`).

An episode's row is its prompt (with ``reset``'s observation, if any, appended) and one completion made of its
model turns and the observations between them. Each model turn is generated from the episode's token ids as they
are (never a re-tokenized transcript): the engine's ids and behavior logprobs of the turn are appended, then the
observation, tokenized on its own (:class:`ObservationFormat`: inside the chat template's tool turn, or the user
turn where there is no tool role; as is without a chat template), with mask 0 and logprob 0. ``turn_ends`` records
where each model turn ends.

Scheduling: each round, the episodes ready for a model turn are generated together in one engine call (one
completion each; the engine batches them continuously), and as soon as the engine hands one back its turn goes to
its environment (:class:`distrl.rollout.envs.pool.EnvPool`, never waited for); replies are read between the
engine's hand-backs and between calls, so an episode waiting for its tool holds back neither the others' decoding
nor the groups that end meanwhile, which are yielded (and PUT) at once. An episode whose reply comes during a call
joins the next call.

Limits: ``--max_new_tokens`` per model turn; ``--env_max_turns``; ``--env_max_tokens`` (completion tokens of the
episode, model and observations) and ``--max_model_len``: an episode that reaches one ends, cut (finish_reason
``length``, counted in :attr:`EpisodeRunner.cut`; a turn past the limit is cut there, its kept tokens' logprobs
unchanged). An environment's error, crash or timeout ends its episode (finish_reason ``error``, counted in
:attr:`EpisodeRunner.errors`; the row is kept with mask 0 and reward 0, and gets no advantage). An environment's
``stop`` strings end a turn: its tokens are cut after the first token whose text completes one.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Iterator

from distrl.rollout.engines.base import Completion, PromptResult
from distrl.rollout.envs.pool import EnvPool

log = logging.getLogger("distrl.actor")
WAIT_S = 0.05  # longest wait for an environment's reply when no episode is ready for a turn


@dataclass
class EpisodeCompletion(Completion):
    """An episode as one completion: ``token_ids``/``logprobs`` over model and observation tokens,
    ``loss_mask`` (1: the model's), ``turn_ends``, and the environment's final ``reward`` and ``components``."""

    prompt_ids: list[int] = field(default_factory=list)  # the episode's prompt (with reset's observation)
    loss_mask: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)


@dataclass
class Episode:
    key: tuple[int, int]  # (prompt index, completion index in its group)
    context: list[int]  # prompt ids + completion ids so far: what the next turn generates from
    prompt_len: int
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the model's turns and the observations, as decoded
    stop: tuple[str, ...] = ()
    started: bool = False  # reset answered
    turns: int = 0
    last_token: int | None = None  # the stop token the last turn ended with (None: cut or at its budget)
    reward: float = 0.0
    info: dict = field(default_factory=dict)
    finish: str | None = None  # stop | length | error; None while it runs
    versions: tuple[int, int] | None = None

    @property
    def length(self) -> int:
        """Completion tokens so far."""
        return len(self.context) - self.prompt_len


class ObservationFormat:
    """An observation's token ids (see the module docstring). ``chat``: format it as the chat template's tool turn
    (user turn where the template has no tool role), closing the model's turn first as the template does (less
    the stop token the model already wrote)."""

    MARK, REPLY = "\x00OBS\x00", "\x00REPLY\x00"

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.pieces = self._pieces() if chat else None  # (closer, head, tail) around the observation

    def _pieces(self) -> tuple[str, str, str] | None:
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self.REPLY}]
        render = self.tokenizer.apply_chat_template
        try:
            before = render(base, tokenize=False)
        except Exception:  # a template that renders no such conversation: observations go as they are
            return None
        for role in ("tool", "user"):
            try:
                full = render(base + [{"role": role, "content": self.MARK}], tokenize=False, add_generation_prompt=True)
            except Exception:  # a template that refuses the role
                continue
            if full.startswith(before) and self.MARK in full and self.REPLY in before:
                head, tail = full[len(before):].split(self.MARK, 1)
                return before[before.index(self.REPLY) + len(self.REPLY):], head, tail
        return None

    def ids(self, text: str, last_token: int | None) -> list[int]:
        """The ids of observation ``text`` after a turn that ended with ``last_token`` (None: without one)."""
        if self.pieces is not None:
            closer, head, tail = self.pieces
            written = "" if last_token is None else self.tokenizer.decode([last_token])
            if written and closer.startswith(written):
                closer = closer[len(written):]
            text = closer + head + text + tail
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def cut_at_stop(tokenizer, ids: list[int], stops: tuple[str, ...]) -> int | None:
    """The number of leading ``ids`` whose text first holds one of ``stops`` (None: no stop string)."""
    if not stops or not any(s in tokenizer.decode(ids) for s in stops):
        return None
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        if any(s in text for s in stops):
            return k
    return None


class EpisodeRunner:
    """Plays ``--env`` episodes with ``engine`` (see the module docstring); :meth:`run` yields ended groups.

    Args:
        engine: the generation engine (its tokenizer, ``max_model_len`` and ``generate_groups``).
        generation: the task section (env, env_max_turns, env_timeout_s, env_max_tokens).
        max_new_tokens: most tokens per model turn (``--max_new_tokens``).
        chat: observations go through the chat template (the task's prompts do).
    """

    def __init__(self, engine, generation, max_new_tokens: int, chat: bool):
        self.engine, self.max_new_tokens = engine, max_new_tokens
        self.max_turns, self.max_tokens = generation.env_max_turns, generation.env_max_tokens
        self.pool = EnvPool(generation.env, generation.env_timeout_s)
        self.format = ObservationFormat(engine.tokenizer, chat)
        self.errors = self.cut = self.turns = self.episodes = 0  # cumulative counts

    def check(self, problem) -> None:
        """Play ``reset`` once on ``problem``; raise ValueError naming --env if it fails."""
        self.pool.reset([("check",)], [dataclasses.asdict(problem)])
        try:
            replies = []
            while not replies:
                replies = self.pool.poll(WAIT_S)
            if "error" in replies[0][1]:
                raise ValueError(f"--env {self.pool.spec}: reset failed on the first problem: {replies[0][1]['error']}")
        finally:
            self.pool.end(("check",))

    def run(self, problems: list, prompts: list[list[int]], n: int, temperature: float, seed: int | None = None,
            between_steps=None) -> Iterator[list[tuple[int, PromptResult]]]:
        """``n`` episodes per prompt (``problems[i]``, ``prompts[i]``: its token ids), yielding each group of n as
        soon as its last episode ends, as ``Engine.generate_groups`` does: lists of (prompt index, result)."""
        self.live = {(i, j): Episode((i, j), list(p), len(p)) for i, p in enumerate(prompts) for j in range(n)}
        self.ready: list[Episode] = []
        self.groups = {i: n for i in range(len(prompts))}  # episodes still running per group
        self.episodes += len(self.live)
        self.pool.reset(list(self.live), [dataclasses.asdict(problems[i]) for i, _ in self.live])
        self._all = dict(self.live)
        call = 0
        try:
            while self.live:
                yield from self._read_replies(0.0 if self.ready else WAIT_S)
                if not self.ready:
                    continue
                batch, self.ready = self.ready, []
                call_seed = None if seed is None else seed + call * len(self._all)
                call += 1
                for finished in self.engine.generate_groups([e.context for e in batch], 1, temperature,
                                                            self.max_new_tokens, between_steps, seed=call_seed):
                    for j, result in finished:
                        self._on_turn(batch[j], result.completions[0])
                    yield from self._read_replies(0.0)
        finally:
            for key in list(self.live):
                self.pool.end(key)

    def _read_replies(self, wait_s: float) -> Iterator[list[tuple[int, PromptResult]]]:
        """Apply the environments' replies that arrived (waiting up to ``wait_s``); yield the groups that ended."""
        ended = []
        for key, reply in self.pool.poll(wait_s):
            if key in self.live:
                ended += self._on_reply(self.live[key], reply)
        if ended:
            yield ended

    def _room(self, ep: Episode, more: int) -> bool:
        """Whether ``more`` completion tokens and then at least one model token fit the episode's limits."""
        fits_model = len(ep.context) + more + 1 <= (self.engine.max_model_len or float("inf"))
        return fits_model and (self.max_tokens is None or ep.length + more + 1 <= self.max_tokens)

    def _on_turn(self, ep: Episode, c: Completion) -> None:
        """A model turn came back: append it (cut at a stop string or the episode's limits), then ask the
        environment, or end the episode when a limit was reached."""
        ids, logprobs, text = c.token_ids, c.logprobs, c.text
        ep.last_token = ids[-1] if c.finish_reason == "stop" and ids else None
        k = cut_at_stop(self.engine.tokenizer, ids, ep.stop)
        if k is not None:
            ids, logprobs, text, ep.last_token = ids[:k], logprobs[:k], self.engine.tokenizer.decode(ids[:k]), None
        model_len = self.engine.max_model_len or float("inf")
        budget = self.max_tokens - ep.length if self.max_tokens is not None else len(ids)
        left = min(budget, model_len - len(ep.context))
        over = len(ids) > left  # past --env_max_tokens (or --max_model_len): the episode ends, cut
        ids, logprobs = ids[:left], logprobs[:left]
        over = over or (c.finish_reason == "length" and len(ep.context) + len(ids) >= model_len)  # the engine's cut
        ep.context += ids
        ep.logprobs += logprobs
        ep.mask += [1] * len(ids)
        ep.turn_ends.append(ep.length)
        ep.texts.append(text)
        ep.turns += 1
        self.turns += 1
        v = c.versions or (self.engine.version, self.engine.version)
        ep.versions = v if ep.versions is None else (min(ep.versions[0], v[0]), max(ep.versions[1], v[1]))
        if over:
            self.cut += 1
            self._finish(ep, "length")
        else:
            self.pool.step(ep.key, text)

    def _on_reply(self, ep: Episode, reply: dict) -> list[tuple[int, PromptResult]]:
        """Apply one reply of ``ep``'s environment; the groups that ended with it."""
        if "error" in reply:
            if not self.errors:
                log.warning("--env %s: an episode ended with an error: %s (counted in TensorBoard "
                            "actor/env_errors)", self.pool.spec, reply["error"])
            self.errors += 1
            return self._finish(ep, "error")
        observation = reply["observation"]
        if not ep.started:  # reset's reply: its observation belongs to the prompt
            ep.started, ep.stop = True, tuple(reply["stop"])
            ids = self.engine.tokenizer(observation, add_special_tokens=False)["input_ids"] if observation else []
            ep.context += ids
            ep.prompt_len += len(ids)
        else:
            ep.reward, ep.info = reply["reward"], reply["info"]
            if reply["done"] or observation is None:
                return self._finish(ep, "stop")
            if ep.turns >= self.max_turns:
                self.cut += 1
                return self._finish(ep, "length")
            ids = self.format.ids(observation, ep.last_token)
            if not self._room(ep, len(ids)):
                self.cut += 1
                return self._finish(ep, "length")
            ep.context += ids
            ep.logprobs += [0.0] * len(ids)
            ep.mask += [0] * len(ids)
            ep.texts.append(self.engine.tokenizer.decode(ids))
        if not self._room(ep, 0):
            self.cut += 1
            return self._finish(ep, "length")
        self.ready.append(ep)
        return []

    def _finish(self, ep: Episode, reason: str) -> list[tuple[int, PromptResult]]:
        """End ``ep``; its group (prompt index, result) if it was the group's last episode."""
        ep.finish = reason
        del self.live[ep.key]
        self.pool.end(ep.key)
        i = ep.key[0]
        self.groups[i] -= 1
        if self.groups[i]:
            return []
        members = sorted((e for e in self._all.values() if e.key[0] == i), key=lambda e: e.key[1])
        return [(i, PromptResult(members[0].context[:members[0].prompt_len], [_completion(e) for e in members]))]

    def close(self) -> None:
        self.pool.close()


def _completion(ep: Episode) -> EpisodeCompletion:
    error = ep.finish == "error"
    components = {**ep.info, "turns": float(ep.turns), "env_error": float(error)}
    return EpisodeCompletion(ep.context[ep.prompt_len:], ep.logprobs, "".join(ep.texts), ep.finish, ep.versions,
                             prompt_ids=ep.context[:ep.prompt_len], loss_mask=[0] * len(ep.mask) if error else ep.mask,
                             turn_ends=ep.turn_ends, reward=0.0 if error else ep.reward, components=components)
