"""The tiny repos' ids, one name each: tests/conftest.py makes the repos and the local Hub serves
them under these ids."""

from __future__ import annotations


def tiny_id(arch: str) -> str:
    """The id of the tiny repo of `arch` (expertmesh/devtools/tiny/)."""
    return f"expertmesh/tiny-{arch}"


KIMI_K3 = tiny_id("kimi_k3")  # the default: KDA and MLA attention, quantised experts, most tests use it
QWEN3_MOE = tiny_id("qwen3_moe")  # BF16 experts, plain attention
MLX_QWEN3_MOE = tiny_id("mlx_qwen3_moe")  # an mlx-lm conversion: its core is 4-bit already
# Tool-call formats (expertmesh/devtools/tiny/tool_formats.py; the `tool_repos` fixture makes them)
KIMI_K3_TOOLS = tiny_id("kimi_k3_tools")  # K3's XTML tokens in the vocabulary: mlx-lm's kimi_k3 parser
JSON_TOOLS = tiny_id("json_tools")  # <tool_call>{json}</tool_call>: mlx-lm's json_tools parser
PYTHON_TEMPLATE = tiny_id("python_template")  # mlx-lm's Python template of DeepSeek V3.2 (DSML calls)
