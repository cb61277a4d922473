"""Chat templates by name, for ``--chat-template NAME`` (as llama.cpp's tools
take one): for files without a ``tokenizer.chat_template`` or with a wrong one.

Each is a Jinja template over ``messages``, ``add_generation_prompt``,
``bos_token`` and ``eos_token``, rendered like a file's own
(:mod:`ptxgen.llm.text.chat_template`); they write the prompt formats of
llama.cpp's built-in templates of the same names.  A system message goes
where the format has a place for it, else before the first user message.
"""

from __future__ import annotations

import os

__all__ = ["NAMED_TEMPLATES", "chat_template_named", "resolve_chat_template"]

_SYSTEM_FIRST = (
    # the system message (if any) set apart, the rest to loop over
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}")

#: name -> Jinja template
NAMED_TEMPLATES = {
    "chatml": (
        "{% for m in messages %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "llama2": (
        _SYSTEM_FIRST + "{% for m in turns %}"
        "{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' }}"
        "{% if loop.first and system %}{{ '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}{% endif %}"
        "{{ m['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}"
        "{% endfor %}"),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
        " + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    "mistral": (
        _SYSTEM_FIRST + "{{ bos_token }}{% for m in turns %}"
        "{% if m['role'] == 'user' %}{{ '[INST] ' }}"
        "{% if loop.first and system %}{{ system + '\\n\\n' }}{% endif %}"
        "{{ m['content'] + '[/INST]' }}"
        "{% else %}{{ ' ' + m['content'] | trim + eos_token }}{% endif %}"
        "{% endfor %}"),
    "phi3": (
        "{{ bos_token }}{% for m in messages %}"
        "{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"),
    "gemma": (
        _SYSTEM_FIRST + "{{ bos_token }}{% for m in turns %}"
        "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' }}"
        "{% if loop.first and system %}{{ system + '\\n\\n' }}{% endif %}"
        "{{ m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"),
    "zephyr": (
        "{% for m in messages %}"
        "{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"),
    "vicuna": (
        _SYSTEM_FIRST + "{% if system %}{{ system + '\\n\\n' }}{% endif %}"
        "{% for m in turns %}"
        "{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + '\\n' }}"
        "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token + '\\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"),
}


def chat_template_named(name: str) -> str:
    """The built-in template ``name``.

    Raises
    ------
    ValueError
        If there is none of that name (the message lists the names).
    """
    try:
        return NAMED_TEMPLATES[name]
    except KeyError:
        raise ValueError(f"no built-in chat template {name!r}; built-in: "
                         f"{', '.join(NAMED_TEMPLATES)}") from None


def resolve_chat_template(value: str) -> str:
    """``--chat-template VALUE``: a built-in name, or a file holding a Jinja
    template (``.jinja`` or any other file that exists).

    Raises
    ------
    ValueError
        If ``value`` is neither (the message lists the names).
    OSError
        If the file cannot be read.
    """
    if value in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[value]
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    raise ValueError(f"--chat-template {value!r} is neither a built-in template "
                     f"({', '.join(NAMED_TEMPLATES)}) nor a file")
