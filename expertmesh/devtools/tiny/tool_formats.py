"""Tiny repos whose chat templates and vocabularies speak real tool-call formats.

mlx-lm picks a model's tool parser from its chat template or its vocabulary
(`mlx_lm.tokenizer_utils._infer_tool_parser`), and renders `tools=` through the template, which
may be Jinja or Python (`chat_template_type` in tokenizer_config.json names a module of
`mlx_lm.chat_templates`). So a test of tool calling needs repos that carry the markup itself:

- `kimi_k3_tools`: the tiny Kimi K3 with K3's XTML tokens (`<|open|>`, `<|close|>`, `<|sep|>`,
  `<|end_of_msg|>`) in its vocabulary, from which mlx-lm picks its `kimi_k3` parser, and a Jinja
  template that writes tools and calls in that markup;
- `json_tools`: the tiny Qwen3-MoE with a Qwen-style template (`<tool_call>{json}</tool_call>`,
  the tool list in the system turn), from which mlx-lm picks `json_tools`;
- `python_template`: the tiny Qwen3-MoE with mlx-lm's Python template of DeepSeek V3.2
  (`chat_template_type: deepseek_v32`), whose calls are DSML blocks.

Each is the base tiny repo's weights (linked, not copied) with a tokenizer trained with the
format's markup as added tokens; the vocabulary keeps the base model's size, so the weights fit.
Random weights never write a call by themselves: tests force one through the sampler.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from expertmesh.devtools.tiny.common import write_generation_config
from expertmesh.devtools.tiny.tokenizer import EOS_TOKEN, build_tokenizer

VOCAB_SIZE = 448  # the base tiny repos' vocabulary (kimi_k3 and qwen3_moe)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# K3's XTML: a message is <|open|>role<|sep|>text<|end_of_msg|>, a call's arguments one JSON
# object block. No "<tool_call>"-like text appears, so mlx-lm infers the parser from the vocabulary.
KIMI_K3_TEMPLATE = (
    "{%- if tools -%}<|open|>system<|sep|>You may call these tools:\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor -%}<|end_of_msg|>{%- endif -%}"
    "{%- for message in messages -%}"
    "<|open|>{{ message['role'] }}<|sep|>"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{{ message['content'] or '' }}<|open|>tools<|sep|>"
    "{%- for tc in message['tool_calls'] -%}"
    '<|open|>call tool="{{ tc["function"]["name"] }}" index="{{ loop.index }}"<|sep|>'
    '<|open|>json type="object"<|sep|>{{ tc["function"]["arguments"] | tojson }}<|close|>json<|sep|>'
    "<|close|>call<|sep|>"
    "{%- endfor -%}<|close|>tools<|sep|>"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ message.get('tool_call_id', '') }}: {{ message['content'] }}"
    "{%- else -%}{{ message['content'] }}{%- endif -%}"
    "<|end_of_msg|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|open|>assistant<|sep|>{%- endif -%}"
)

# Qwen2.5's way: the tools in the system turn, a call as <tool_call>{json}</tool_call>, a result
# as a user turn holding <tool_response>.
JSON_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{%- endif %}"
    "# Tools\n<tools>{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@dataclass(frozen=True)
class ToolFormat:
    """One family: the base repo it takes its weights from, the markup its tokenizer adds, and its
    template (Jinja text, or the name of one of mlx-lm's Python templates)."""

    base: str
    special_tokens: tuple[str, ...]
    eos_token: str
    jinja: str | None = None
    template_type: str | None = None  # mlx_lm.chat_templates.<name>
    added_tokens: tuple[str, ...] = field(default=())  # markup that is not special (Qwen's <tool_call>)


FORMATS: dict[str, ToolFormat] = {
    "kimi_k3_tools": ToolFormat(
        base="kimi_k3",
        special_tokens=("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
        eos_token="<|end_of_msg|>",
        jinja=KIMI_K3_TEMPLATE,
    ),
    "json_tools": ToolFormat(
        base="qwen3_moe",
        special_tokens=(),
        eos_token=EOS_TOKEN,
        jinja=JSON_TOOLS_TEMPLATE,
        added_tokens=("<tool_call>", "</tool_call>"),
    ),
    "python_template": ToolFormat(
        base="qwen3_moe",
        special_tokens=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        eos_token="<｜end▁of▁sentence｜>",
        template_type="deepseek_v32",
    ),
}


def make_tool_repo(out: Path, family: str, base_repo: Path) -> Path:
    """Write the `family` repo into `out` (replacing it) from the built tiny repo `base_repo`.

    Raises:
        ValueError: `family` is not one of `FORMATS`.
    """
    if family not in FORMATS:
        raise ValueError(f"unknown tool format {family!r}; choose from {', '.join(FORMATS)}")
    fmt = FORMATS[family]
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for f in base_repo.iterdir():
        if f.is_file() and f.name not in _TOKENIZER_FILES:
            os.link(f, staging / f.name)  # the weights are the base repo's, byte for byte
    tok = build_tokenizer(VOCAB_SIZE - len(fmt.added_tokens), fmt.special_tokens)
    if fmt.added_tokens:
        tok.add_tokens(list(fmt.added_tokens))
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise ValueError(f"the {family} vocabulary has {tok.get_vocab_size()} tokens, the model {VOCAB_SIZE}")
    tok.save(str(staging / "tokenizer.json"))
    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": fmt.eos_token,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    if fmt.jinja is not None:
        config["chat_template"] = fmt.jinja
    if fmt.template_type is not None:
        config["chat_template_type"] = fmt.template_type
    (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    eos = tok.token_to_id(fmt.eos_token)
    if eos is None:
        raise ValueError(f"the {family} tokenizer has no {fmt.eos_token!r}")
    write_generation_config(staging, eos)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
