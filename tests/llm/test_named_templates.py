"""The built-in chat templates (``--chat-template NAME``) write the prompt
formats of llama.cpp's templates of the same names.

The expected texts are those of llama.cpp's tests/test-chat-template.cpp
for its conversation (system, user, assistant, user, assistant with
surrounding spaces, user), with BOS written as "" (encode_chat adds BOS
through the tokenizer) and EOS as "</s>"."""

import pytest

from ptxgen.llm.named_templates import (NAMED_TEMPLATES, chat_template_named,
                                        resolve_chat_template)
from ptxgen.llm.text.chat_template import render_chat

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]

EXPECTED = {
    "chatml": "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\n"
              "Hello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\n"
              "Who are you<|im_end|>\n<|im_start|>assistant\n   I am an assistant   <|im_end|>\n"
              "<|im_start|>user\nAnother question<|im_end|>\n<|im_start|>assistant\n",
    "llama2": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST] Hi there "
              "</s>[INST] Who are you [/INST]    I am an assistant    </s>[INST] Another "
              "question [/INST]",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant"
              "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nI am an assistant<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "[INST] You are a helpful assistant\n\nHello[/INST] Hi there</s>[INST] Who are "
               "you[/INST] I am an assistant</s>[INST] Another question[/INST]",
    "phi3": "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n"
            "<|assistant|>\nHi there<|end|>\n<|user|>\nWho are you<|end|>\n<|assistant|>\n"
            "   I am an assistant   <|end|>\n<|user|>\nAnother question<|end|>\n<|assistant|>\n",
    "gemma": "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n"
             "<start_of_turn>model\nHi there<end_of_turn>\n<start_of_turn>user\nWho are you"
             "<end_of_turn>\n<start_of_turn>model\nI am an assistant<end_of_turn>\n"
             "<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n",
    "zephyr": "<|system|>\nYou are a helpful assistant</s>\n<|user|>\nHello</s>\n<|assistant|>\n"
              "Hi there</s>\n<|user|>\nWho are you</s>\n<|assistant|>\n   I am an assistant   "
              "</s>\n<|user|>\nAnother question</s>\n<|assistant|>\n",
    "vicuna": "You are a helpful assistant\n\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who "
              "are you\nASSISTANT:    I am an assistant   </s>\nUSER: Another question\n"
              "ASSISTANT:",
}


def test_every_template_has_an_expected_text():
    assert set(EXPECTED) == set(NAMED_TEMPLATES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_template_writes_llama_cpp_format(name):
    text = render_chat(chat_template_named(name), CONVERSATION, add_generation_prompt=True,
                       bos_token="", eos_token="</s>")
    assert text == EXPECTED[name]


@pytest.mark.parametrize("name", ["llama2", "gemma", "llama3"])
def test_bos_is_written_where_the_format_has_it(name):
    text = render_chat(chat_template_named(name), CONVERSATION[1:2], bos_token="<s>")
    assert text.startswith("<s>")


def test_names_files_and_unknown_values(tmp_path):
    assert resolve_chat_template("chatml") == NAMED_TEMPLATES["chatml"]
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    assert resolve_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="neither a built-in template .*chatml.* nor a file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="no built-in chat template 'x'; built-in: chatml"):
        chat_template_named("x")
