"""Shared helpers of the data tests: tokenizer directories built from the real Qwen3 tokenizer files (no download)."""
import json, shutil
from pathlib import Path

from dflash_nb.records import qwen3_tokenizer_dir

_REASONING_IF = "{%- if loop.index0 > ns.last_query_index %}"
_GEN = "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}"
_GEN36 = ("{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n"
          "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- else %}\n        {{- '<think>\\n' }}\n    {%- endif %}")
_TOOL_BRANCH_START = '{%- elif message.role == "tool" %}'


def tokenizer_copy(dest: Path, template=None, backend=None) -> Path:
    "A copy of the real Qwen3 tokenizer directory in `dest`; `template(text)` / `backend(json)` rewrite its chat template / tokenizer.json."
    dest = Path(dest)
    shutil.copytree(qwen3_tokenizer_dir(), dest)
    if template is not None:
        cfg = json.loads((dest / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template(cfg["chat_template"])
        (dest / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
        (dest / "chat_template.jinja").unlink(missing_ok=True)
    if backend is not None:
        (dest / "tokenizer.json").write_text(json.dumps(backend(json.loads((dest / "tokenizer.json").read_text())), ensure_ascii=False))
    return dest


def qwen36_style(t: str) -> str:
    "A Qwen3.6-style template: the generation prompt opens the thinking block, and `preserve_thinking` keeps the reasoning of earlier turns."
    assert t.count(_REASONING_IF) == 1 and t.count(_GEN) == 1, "the Qwen3 template changed"
    return (t.replace(_REASONING_IF, "{%- if (preserve_thinking is defined and preserve_thinking) or loop.index0 > ns.last_query_index %}")
             .replace(_GEN, _GEN36))


def drops_tool_turns(t: str) -> str:
    "A template that silently leaves out `tool` messages (its tool branch removed)."
    i = t.index(_TOOL_BRANCH_START)
    j = t.index("{%- endif %}\n{%- endfor %}", i)
    return t[:i] + t[j:]
