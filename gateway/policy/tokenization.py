"""The model's own chat template and tokenizer, used by the gateway (token-in/token-out).

Example::

    tok = ChatTokenizer.load("./tiny-model")
    text = tok.render([{"role": "user", "content": "hi"}], tools=None, add_generation_prompt=True)
    ids = tok.encode(text)
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from core.errors import ContextLengthExceeded, InvalidRequest


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode → byte table, inverted (byte-level BPE token strings to raw bytes)."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def compile_template(source: str) -> Template:
    """Compile a chat template the way Hugging Face does: a sandboxed jinja environment with
    ``trim_blocks``/``lstrip_blocks``, loop controls, ``tojson`` and ``raise_exception``."""

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    template = env.from_string(source)
    # One flat dict in place of jinja's ChainMap over the template's and the environment's globals:
    # each render copies them into its context, and iterating a ChainMap was most of a short render's
    # own cost (41 -> 29 us a render; a twentieth of a gateway's CPU under `belayer bench scale`).
    template.globals = dict(template.globals)
    return template


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; joined deltas equal ``decode(all ids)``."""

    def __init__(self, tokenizer: Tokenizer, hidden: frozenset[int] | None = None) -> None:
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=hidden is None)
        self._hidden = hidden or frozenset()
        """With special tokens shown: the ones still hidden (the EOS tokens)."""

    def step(self, token_id: int) -> str:
        if token_id in self._hidden:
            return ""
        return self._stream.step(self._tok, token_id) or ""


def text_chars(value: Any) -> int:
    """The characters in every string of `value` (a cheap lower bound on a rendered prompt's text).

    >>> text_chars([{"role": "user", "content": "hello"}, {"content": [{"text": "abc"}]}])
    12
    """
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


class ChatTokenizer:
    """Renders chat messages with the model's template and maps text to and from token ids."""

    def __init__(self, tokenizer: Tokenizer, template: str, eos_token: str, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token = eos_token
        self.eos_ids = eos_ids
        self._template = compile_template(template)
        self._bytes: dict[int, bytes] = {}
        # Added tokens (specials, tags) are stored as plain text, not in byte-level form.
        self._added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        self.max_token_bytes = max(len(t.encode()) for t in tokenizer.get_vocab(with_added_tokens=True))
        """The most UTF-8 bytes one token's vocabulary entry spans (an upper bound on the text one
        token covers), so that a text of n characters has at least n / max_token_bytes tokens."""

    def bound_prompt(self, limit: int, *parts: Any) -> None:
        """Refuse a prompt that certainly exceeds a context window of `limit` tokens, before templating
        and tokenizing it (seconds of CPU for megabytes of text): the characters of every string in
        `parts` (`text_chars`) take at least that many / ``max_token_bytes`` tokens."""
        chars = text_chars(list(parts))
        if limit and chars > limit * self.max_token_bytes:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, your messages hold "
                f"{chars} characters, which is more than {limit} tokens of any text. Please reduce the "
                "length of the messages.",
                param="messages",
            )

    @classmethod
    def load(cls, model_dir: str | Path) -> ChatTokenizer:
        """Load ``tokenizer.json``, the chat template and the EOS ids straight from the model directory
        (without importing transformers and torch: seconds of start-up)."""
        root = Path(model_dir)
        cfg = _read_json(root / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if not template and (root / "chat_template.jinja").exists():
            template = (root / "chat_template.jinja").read_text()
        if not isinstance(template, str):
            raise ValueError(f"{model_dir} has no chat template; Belayer needs the model's own template")
        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        eos = cfg.get("eos_token")
        eos_token = str(eos.get("content") if isinstance(eos, dict) else eos)
        ids = {tokenizer.token_to_id(eos_token)}
        gen = _read_json(root / "generation_config.json").get("eos_token_id")
        ids |= set(gen if isinstance(gen, list) else [gen])
        return cls(tokenizer, template, eos_token, frozenset(i for i in ids if isinstance(i, int)))

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        try:
            return str(
                self._template.render(
                    messages=messages,
                    tools=tools or None,
                    add_generation_prompt=add_generation_prompt,
                    eos_token=self.eos_token,
                )
            )
        except TemplateError as e:
            raise InvalidRequest(
                f"the model's chat template rejected these messages: {e}",
                param="messages",
                code="template_error",
            ) from e

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's character span in `text`."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return list(enc.ids), [(int(a), int(b)) for a, b in enc.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def detokenizer(self, special: bool = False) -> IncrementalDetokenizer:
        """``special``: special tokens are text too (but EOS), as vLLM decodes for parsers whose tags
        are special tokens (Mistral's ``[TOOL_CALLS]``)."""
        return IncrementalDetokenizer(self.tokenizer, self.eos_ids if special else None)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (a byte-level token may hold part of a UTF-8 character)."""
        cached = self._bytes.get(token_id)
        if cached is None:
            piece = self.tokenizer.id_to_token(token_id)
            if piece is None:
                cached = b""
            elif piece in self._added:
                cached = piece.encode()
            else:
                table = _byte_decoder()
                cached = bytes(table[c] for c in piece if c in table)
            self._bytes[token_id] = cached
        return cached

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))
