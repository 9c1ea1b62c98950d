"""Chat templates chosen by name (llama-server's `--chat-template NAME`), and the rule for the flag's value.

llama-server knows many formats by name; these are the common ones, written as Jinja templates with the
usual variables (messages, add_generation_prompt, bos_token, eos_token). Anything else must be a Jinja
template itself (or come from `--chat-template-file`).
"""

from __future__ import annotations

from specserve.errors import SpecserveError
from specserve.gguf.chat_template import check_template


def _gen(prompt: str) -> str:
    """The template's tail: the assistant's header when add_generation_prompt."""
    return "{%- if add_generation_prompt -%}{{ '" + prompt + "' }}{%- endif -%}"


BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": "{%- for message in messages -%}"
              "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
              "{%- endfor -%}" + _gen("<|im_start|>assistant\\n"),
    "llama3": "{{- bos_token -}}{%- for message in messages -%}"
              "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
              " + '<|eot_id|>' }}{%- endfor -%}" + _gen("<|start_header_id|>assistant<|end_header_id|>\\n\\n"),
    "llama2": "{{- bos_token -}}{%- for message in messages -%}"
              "{%- if message['role'] == 'user' -%}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
              "{%- elif message['role'] == 'assistant' -%}{{ message['content'] + eos_token }}"
              "{%- else -%}{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}{%- endif -%}"
              "{%- endfor -%}",
    "gemma": "{{- bos_token -}}{%- for message in messages -%}"
             "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
             "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
             "{%- endfor -%}" + _gen("<start_of_turn>model\\n"),
    "phi3": "{%- for message in messages -%}"
            "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
            "{%- endfor -%}" + _gen("<|assistant|>\\n"),
    "zephyr": "{%- for message in messages -%}"
              "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
              "{%- endfor -%}" + _gen("<|assistant|>\\n"),
}


def resolve_chat_template(name_or_jinja: str | None, file: str | None) -> str | None:
    """The Jinja text `--chat-template` / `--chat-template-file` ask for (None: the GGUF's own), compiled
    once here so a broken template is refused at start-up."""
    if name_or_jinja and file:
        raise SpecserveError("give --chat-template or --chat-template-file, not both")
    if file:
        try:
            with open(file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecserveError(f"cannot read --chat-template-file {file}: {exc}") from None
        if not text.strip():
            raise SpecserveError(f"--chat-template-file {file} is empty")
    elif name_or_jinja in BUILTIN_TEMPLATES:
        text = BUILTIN_TEMPLATES[name_or_jinja]
    elif name_or_jinja:
        text = name_or_jinja
        if "{{" not in text and "{%" not in text:
            raise SpecserveError(f"unknown chat template {name_or_jinja!r}: give a built-in name "
                                 f"({', '.join(BUILTIN_TEMPLATES)}), a Jinja template or --chat-template-file")
    else:
        return None
    check_template(text)
    return text
