"""Chat templates: real models' templates rendered exactly, the sandbox, multi-turn tokens."""

import datetime
import json
import os

import pytest

from ptxgen.llm.text.chat_template import (ChatTemplateError, encode_chat,
                                               incremental_chat_tokens, render_chat)
from ptxgen.llm.text.tokenizer import Tokenizer

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "vocab")

# Meta-Llama-3-8B-Instruct's tokenizer_config.json
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Mistral-7B-Instruct-v0.1's tokenizer_config.json
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)

# ChatML in the multi-line style of Qwen2.5's templates
CHATML = """{%- for message in messages %}
    {%- if loop.first and messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

@pytest.fixture(scope="module")
def llama3():
    return Tokenizer.from_gguf(os.path.join(DATA, "ggml-vocab-llama-bpe.gguf"))


CONVO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  Hi there!  "},
]


def test_llama3_template():
    out = render_chat(LLAMA3, CONVO, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    assert out == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse."
                   "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")
    no_prompt = render_chat(LLAMA3, CONVO, add_generation_prompt=False,
                            bos_token="<|begin_of_text|>")
    assert out.startswith(no_prompt) and no_prompt.endswith("Hi there!<|eot_id|>")


def test_mistral_template_and_raise_exception():
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"}]
    out = render_chat(MISTRAL, msgs, bos_token="<s>", eos_token="</s>")
    assert out == "<s>[INST] Hi [/INST]Hello!</s>[INST] How are you? [/INST]"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(MISTRAL, msgs[:1] * 2, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles"):
        render_chat(MISTRAL, [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_chatml_template_whitespace_control():
    out = render_chat(CHATML, [{"role": "user", "content": "Hello"}])
    assert out == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                   "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    # trim_blocks and lstrip_blocks, as transformers sets them
    t = "{% for m in messages %}\n    {% if true %}\n{{ m.role }}\n    {% endif %}\n{% endfor %}"
    assert render_chat(t, [{"role": "user", "content": ""}]) == "user\n"


def test_templates_stored_in_gguf_files():
    qwen = Tokenizer.from_gguf(os.path.join(DATA, "ggml-vocab-qwen2.gguf"))
    assert qwen.apply_chat_template([{"role": "user", "content": "2+2?"}]) == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    phi = Tokenizer.from_gguf(os.path.join(DATA, "ggml-vocab-phi-3.gguf"))
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert phi.apply_chat_template(msgs) == "<s><|user|>\nHi<|end|>\n<|assistant|>\nYo<|end|>\n"


def test_tojson_strftime_loopcontrols():
    msgs = [{"role": "user", "content": "<b>&'é"}, {"role": "assistant", "content": "x"}]
    assert render_chat("{{ messages | tojson }}", msgs) == json.dumps(msgs, ensure_ascii=False)
    assert render_chat("{{ messages[0] | tojson(indent=2, sort_keys=True) }}", msgs) == \
        json.dumps(msgs[0], indent=2, sort_keys=True, ensure_ascii=False)
    assert render_chat("{{ strftime_now('%Y') }}", msgs) == str(datetime.date.today().year)
    t = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    assert render_chat(t, msgs) == "user"
    assert render_chat("{{ tools[0] }}|{{ add_generation_prompt }}", msgs, tools=["calc"],
                       add_generation_prompt=False) == "calc|False"


def test_sandbox_keeps_inputs_and_internals():
    msgs = [{"role": "user", "content": "a"}]
    with pytest.raises(ChatTemplateError):
        render_chat("{% set _ = messages.append({'role': 'x'}) %}", msgs)
    assert msgs == [{"role": "user", "content": "a"}]
    with pytest.raises(ChatTemplateError):
        render_chat("{{ ''.__class__.__mro__[1].__subclasses__() }}", msgs)


def test_template_errors_are_clear(llama3):
    msgs = [{"role": "user", "content": "a"}]
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(None, msgs)
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        render_chat("ok\n{% for %}", msgs)
    with pytest.raises(ChatTemplateError, match="list of dicts"):
        render_chat(LLAMA3, "hello")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat("{{ messages[0]['content'] + 1 }}", msgs)
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] has no 'role'"):
        render_chat(LLAMA3, [msgs[0], {"content": "x"}])
    assert llama3.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        llama3.apply_chat_template(msgs)


def test_encode_chat_single_bos(llama3):
    ids = encode_chat(llama3, CONVO, template=LLAMA3)
    assert ids[0] == llama3.bos_id and ids[1] != llama3.bos_id
    assert ids.count(128009) == 2  # one <|eot_id|> per message
    assert llama3.decode(ids, special=True) == render_chat(
        LLAMA3, CONVO, bos_token="<|begin_of_text|>")


def test_incremental_tokens_equal_full_encoding(llama3):
    # three turns: what each new turn feeds, appended to what the cache holds,
    # is the whole conversation's encoding
    turns = [("Hi!", "Hello. How can I help?"), ("What is 2+2?", "4."), ("Thanks", None)]
    msgs = [{"role": "system", "content": "Be brief."}]
    cache = None
    for user, reply in turns:
        prev = list(msgs)
        msgs.append({"role": "user", "content": user})
        if cache is None:
            cache = encode_chat(llama3, msgs, template=LLAMA3)
        else:
            new = incremental_chat_tokens(llama3, prev, msgs, template=LLAMA3)
            assert new[0] == 128006  # <|start_header_id|>: nothing before is re-fed
            cache += new
        assert cache == encode_chat(llama3, msgs, template=LLAMA3)
        if reply is not None:
            # the model's reply and its <|eot_id|> enter the cache
            cache += llama3.encode(reply, add_special=False) + [128009]
            msgs.append({"role": "assistant", "content": reply})
    # the other way: the cache cut back to the prompt, the reply re-fed as text
    prev = msgs[:-2]
    new = incremental_chat_tokens(llama3, prev, msgs, prev_add_generation_prompt=True,
                                  template=LLAMA3)
    assert llama3.decode(new, special=True).startswith("4.<|eot_id|>")


def test_incremental_refuses_rewritten_history(llama3):
    counting = "{{ messages | length }}:{% for m in messages %}{{ m.content }};{% endfor %}"
    a = [{"role": "user", "content": "x"}]
    b = a + [{"role": "assistant", "content": "y"}]
    with pytest.raises(ChatTemplateError, match="not a prefix"):
        incremental_chat_tokens(llama3, a, b, template=counting)
