"""A tokenizer as a prompt-length check uses one, without transformers' tokenizer classes.

``from transformers import AutoTokenizer`` imports torch: about 5 s of a driver's start-up on the GPU host (and
3-6 s of CPU on a 2-core machine), spent before Ray starts, only to count prompt tokens. :class:`PromptEncoder`
gives the driver's preflight (:mod:`distrl.rollout.prompt_fit`) the two calls it makes, from the files a
tokenizer directory already holds:

- ``encoder(text)["input_ids"]``: the `tokenizers` library's encoding of ``tokenizer.json`` with its
  post-processor (the special tokens a transformers fast tokenizer adds by default);
- ``encoder.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``: transformers' own
  Jinja renderer (``transformers.utils.chat_template_utils``, which does not import torch) with the chat
  template and the named special tokens (``bos_token``, ``eos_token``, ...) that ``tokenizer_config.json``
  holds, as ``PreTrainedTokenizerBase.apply_chat_template`` passes them.

:meth:`PromptEncoder.from_dir` returns None where these files cannot reproduce the tokenizer (no
``tokenizer.json``; a config that asks transformers to add a BOS or EOS token the file's post-processor may
not have): the caller then loads the transformers tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class PromptEncoder:
    """Encodes prompts and renders chat templates like the transformers tokenizer of the same files.

    Args:
        core: a ``tokenizers.Tokenizer``.
        chat_template: the Jinja chat template (None: the tokenizer has none).
        special_tokens: the named special tokens' strings, passed to the template.
        digest: a hex digest of the files it was read from (:meth:`from_dir`; None: built otherwise), which names
            this tokenizer in caches of what it measured.
    """

    def __init__(self, core, chat_template: str | None = None, special_tokens: dict[str, str] | None = None,
                 digest: str | None = None):
        self._core, self.chat_template, self.special_tokens = core, chat_template, dict(special_tokens or {})
        self.digest = digest

    def __call__(self, text: str) -> dict[str, list[int]]:
        """``{"input_ids": ids}`` of `text`, with the tokenizer's default special tokens."""
        return {"input_ids": self._core.encode(text).ids}

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        """The chat template rendered over `messages` (text only: `tokenize` must be False).

        Raises ValueError when the tokenizer has no chat template or `tokenize` is True."""
        if not self.chat_template or tokenize:
            raise ValueError("PromptEncoder renders a chat template to text only, and needs one")
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt, **self.special_tokens)
        return rendered[0]

    @classmethod
    def from_dir(cls, directory: str | Path) -> PromptEncoder | None:
        """The encoder of a tokenizer directory, or None when its files cannot reproduce the transformers
        tokenizer (see the module's docstring)."""
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            return None
        config = _read_json(directory / "tokenizer_config.json")
        if config.get("add_bos_token") or config.get("add_eos_token"):
            return None
        template = _chat_template(directory, config)
        if template is False:
            return None
        from tokenizers import Tokenizer

        specials = {name: _content(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
        raw = (directory / "tokenizer.json").read_bytes()
        return cls(Tokenizer.from_str(raw.decode("utf-8")), template, specials, hashlib.sha256(raw).hexdigest())


def _chat_template(directory: Path, config: dict) -> str | None | bool:
    """The directory's default chat template: ``chat_template.jinja``, else the config's; None: none; False: one
    this encoder does not pick (several named templates without a ``default``)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default", False)
    return template


def _content(token) -> str:
    """A special token's string: config files hold a string or an AddedToken dict."""
    return token["content"] if isinstance(token, dict) else str(token)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
