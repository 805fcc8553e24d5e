"""The model's own chat template and tokenizer, used by the gateway (token-in/token-out).

Example::

    tok = ChatTokenizer.load("./tiny-model")
    text = tok.render([{"role": "user", "content": "hi"}], tools=None, add_generation_prompt=True)
    ids = tok.encode(text)
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


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


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; joined deltas equal ``decode(all ids)``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""


class ChatTokenizer:
    """Renders chat messages with the model's template and maps text to and from token ids."""

    def __init__(self, tokenizer: Tokenizer, template: str, eos_token: str, eos_ids: frozenset[int]) -> None:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self.tokenizer = tokenizer
        self.eos_token = eos_token
        self.eos_ids = eos_ids
        self._template = _compile_jinja_template(template)
        self._bytes: dict[int, bytes] = {}
        # Added tokens (specials, tags) are stored as plain text, not in byte-level form.
        self._added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}

    @classmethod
    def load(cls, model_dir: str | Path) -> ChatTokenizer:
        from transformers import AutoTokenizer, GenerationConfig

        hf = AutoTokenizer.from_pretrained(str(model_dir))
        template = hf.chat_template
        if not isinstance(template, str):
            raise ValueError(f"{model_dir} has no chat template; Belayer needs the model's own template")
        eos_ids = {hf.eos_token_id} if hf.eos_token_id is not None else set()
        try:
            gen = GenerationConfig.from_pretrained(str(model_dir))
            extra = gen.eos_token_id
            eos_ids |= set(extra if isinstance(extra, list) else [extra] if extra is not None else [])
        except OSError:
            pass
        return cls(hf.backend_tokenizer, template, str(hf.eos_token), frozenset(eos_ids))

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        return str(
            self._template.render(
                messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt
            )
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer)

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
