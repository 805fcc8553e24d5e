"""The tiny model's template and tokenizer, as the gateway uses them."""

from __future__ import annotations

from pathlib import Path

from belayer.testing.tiny_model import CONTEXT_WINDOW
from gateway.policy.tokenization import ChatTokenizer


def test_template_renders_tools_hermes_style(tokenizer: ChatTokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "ls"}}}],
        },
        {"role": "tool", "content": "a.py"},
    ]
    text = tokenizer.render(msgs, tools, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nsys\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "bash"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
        in text
    )
    assert text.endswith("<|im_start|>tool\na.py<|im_end|>\n<|im_start|>assistant\n")


def test_rendering_extends_each_prefix(tokenizer: ChatTokenizer) -> None:
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    for k in range(1, len(msgs)):
        assert tokenizer.render(msgs, None, True).startswith(tokenizer.render(msgs[:k], None, False))


def test_roundtrip_and_token_bytes(tokenizer: ChatTokenizer) -> None:
    text = "déjà vu: <tool_call> 🤖 done"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    detok = tokenizer.detokenizer()
    assert "".join(detok.step(i) for i in ids) == text


def test_context_window_and_determinism(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json

    from belayer.testing.tiny_model import build_tiny

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["max_position_embeddings"] == CONTEXT_WINDOW >= 65536
    build_tiny(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_template_errors_are_bad_requests(tokenizer: ChatTokenizer) -> None:
    import pytest

    from core.errors import InvalidRequest

    strict = ChatTokenizer(
        tokenizer.tokenizer, "{{ raise_exception('roles must alternate') }}", "<|im_end|>", tokenizer.eos_ids
    )
    with pytest.raises(InvalidRequest, match="roles must alternate") as e:
        strict.render([{"role": "user", "content": "a"}], None, True)
    assert e.value.code == "template_error" and e.value.param == "messages"


def test_loads_without_transformers(tiny_model_dir: Path) -> None:
    """The gateway's tokenizer equals Hugging Face's for the same directory."""
    from transformers import AutoTokenizer

    ours = ChatTokenizer.load(tiny_model_dir)
    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert ours.render(msgs, None, True) == hf.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert ours.eos_ids == {hf.eos_token_id} and ours.encode("a b") == hf.encode(
        "a b", add_special_tokens=False
    )
