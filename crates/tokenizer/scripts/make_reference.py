#!/usr/bin/env python3
"""Reference data for trellm-tokenizer's tests (tests/fixtures/reference.json).

- SmolLM2 (GGUF "gpt2" BPE): ids and decodes from the Hugging Face `tokenizers` library on the
  tokenizer.json that /work/shared/oracle/gguf_to_hf.py writes (what mlx-lm uses), chat
  renderings from transformers' apply_chat_template on that folder.
- Gemma 3 (GGUF "llama" SentencePiece): ids from llama.cpp (llama-cpp-python, vocab only,
  parse_special=True), which is where the gemma goldens' prompt ids come from.
- Template behaviour: small templates exercising jinja features, rendered by transformers.
- tiny-tokenizer: ids and renderings of the small HF tokenizer copied into tests/fixtures.

Usage (the venv at /tmp/oracle has gguf, tokenizers, transformers, jinja2, llama-cpp-python):
  python gguf_to_hf.py SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol-hf
  python make_reference.py /tmp/smol-hf gemma-3-270m-q4_k_m.gguf TINY_DIR OUT.json
"""
import json
import sys

from tokenizers import Tokenizer
from transformers import AutoTokenizer
import llama_cpp

STRINGS = [
    "Hello, world!",
    "",
    " ",
    "a",
    "\n",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple   spaces    between     words",
    "tabs\tand\t\ttabs\t",
    "new\nlines\n\n\nand\r\nCRLF\n",
    "Digits: 1234567890, 3.14159 and 1,000,000 (2024-01-31)",
    "Unicode: café naïve résumé Ünïcödé façade",
    "中文文本测试，你好世界！",
    "日本語のテキスト、カタカナ、ひらがな。",
    "한국어 텍스트입니다",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "Math: ∑∫√∞ ≤ ≥ ≠ ± × ÷ → ⇒ ∀x∈ℝ",
    "Special <|im_start|>user\nhi there<|im_end|>\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "Mixed<|im_end|>and<end_of_turn>tokens<bos>",
    "Code:\n    def f(x):\n        return x ** 2  # square\n",
    'JSON: {"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "URL https://example.com/path?query=1&b=2#frag",
    "Arabic: مرحبا بالعالم",
    "Russian: Привет, мир! Ёж.",
    "Greek: Γειά σου Κόσμε",
    "Hindi: नमस्ते दुनिया",
    "Thai: สวัสดีชาวโลก",
    "Rare: 𓀀𓀁 𐌀𐌁 𠀀 ꙮ ᚠᚢᚦ ⍼ 🫨 ḁ",
    "Repeated!!!!!!!???? ....... ------- ______",
    "Contractions: don't, I'm, they'll, we've, she's, it'd",
    "MiXeD CaSe and ALLCAPS and camelCaseWords",
    "<div>html</div> <b>bold</b> <0x41> literal",
    " " * 40 + "x" + "\n" * 40 + "y" + "\t" * 5,
    "Zero\u200bwidth\u200djoiner and \ufeffBOM",
    "Combining: e\u0301 vs \u00e9, A\u030a vs \u00c5",
    "The quick brown fox jumps over the lazy dog. " * 3,
]

CHATS = [
    {"messages": [{"role": "user", "content": "Hi!"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Hi!"}], "add_generation_prompt": False},
    {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi, how can I help?"},
                  {"role": "user", "content": "Tell me a joke 😀\nwith  spaces "}], "add_generation_prompt": True},
]

# Jinja features used by real chat templates; each rendered by transformers.
TEMPLATES = [
    "{{ bos_token }}{% for m in messages %}{{ m.role | upper }}: {{ m.content.strip() }}\n{% endfor %}",
    "{% for m in messages %}{% if m['role'].startswith('sys') %}[S]{% endif %}{{ loop.index }}/{{ loop.length }}"
    "{% if loop.last %} last{% endif %}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}",
    "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ {'b': 1, 'a': [1.5, none, true, 'é\"\\n']} | tojson }}",
    "{{ {'z': 1, 'a': 2} | tojson(sort_keys=true) }} {{ 'ünï' | tojson(ensure_ascii=true) }} {{ [1, 2] | tojson(separators=(',', ':')) }}",
    "{% set ns = namespace(sys='') %}{% for m in messages %}{% if m.role == 'system' %}{% set ns.sys = m.content %}"
    "{% endif %}{% endfor %}sys={{ ns.sys }};{% for m in messages[1:] %}{{ m.content }};{% endfor %}",
    "{%- for m in messages -%}\n    {{- m.content -}}\n    {%- if not loop.last %} | {% endif -%}\n{%- endfor -%}\n",
    "{% for m in messages %}\n  {% if m.role == 'user' %}\n    U:{{ m.content }}\n  {% else %}\n    O:{{ m.content }}\n  {% endif %}\n{% endfor %}\n",
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role: ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}",
    "{{ none }} {{ true }} {{ false }} {{ 3 // 2 }} {{ 7 % 3 }} {{ 'a,b,c'.split(',') | join('+') }} "
    "{{ 'x' * 3 }} {{ messages | length }} {{ (messages | last).content | default('?') }} {{ missing is defined }}",
    "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}{{ 'Hello World'.lower().replace('world', 'there') }}"
    " {{ '  pad  ' | trim }} {{ eos_token }}",
    "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{{ m.content }}{% if loop.index >= 3 %}"
    "{% break %}{% endif %},{% endfor %}",
]
TEMPLATE_CHATS = [
    [{"role": "system", "content": "  You are helpful.  "}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye ünï\n"}],
    [{"role": "user", "content": "only one"}],
    [{"role": "robot", "content": "beep"}],
]


def main(smol_dir, gemma_gguf, tiny_dir, out):
    smol = Tokenizer.from_file(f"{smol_dir}/tokenizer.json")
    smol_tf = AutoTokenizer.from_pretrained(smol_dir)
    gemma = llama_cpp.Llama(model_path=gemma_gguf, vocab_only=True, verbose=False)
    tiny = AutoTokenizer.from_pretrained(tiny_dir)

    encodings = []
    for s in STRINGS:
        sm = smol.encode(s, add_special_tokens=False).ids
        gm = gemma.tokenize(s.encode("utf-8"), add_bos=False, special=True)
        encodings.append({
            "text": s,
            "smollm2": sm,
            "smollm2_decoded": smol.decode(sm, skip_special_tokens=False),
            "gemma": gm,
            "tiny": tiny.encode(s, add_special_tokens=False),
        })

    smol_chats = []
    for c in CHATS:
        smol_chats.append({**c, "rendered": smol_tf.apply_chat_template(
            c["messages"], tokenize=False, add_generation_prompt=c["add_generation_prompt"])})
    tiny_chats = []
    for c in CHATS:
        tiny_chats.append({**c, "rendered": tiny.apply_chat_template(
            c["messages"], tokenize=False, add_generation_prompt=c["add_generation_prompt"])})

    templates = []
    for t in TEMPLATES:
        for msgs in TEMPLATE_CHATS:
            for agp in (True, False):
                case = {"template": t, "messages": msgs, "add_generation_prompt": agp}
                try:
                    case["rendered"] = smol_tf.apply_chat_template(
                        msgs, chat_template=t, tokenize=False, add_generation_prompt=agp)
                except Exception as e:  # template errors are expected for some cases
                    case["error"] = f"{type(e).__name__}: {e}"
                templates.append(case)

    json.dump({
        "about": "made by crates/tokenizer/scripts/make_reference.py; smollm2: HF tokenizers on gguf_to_hf.py's "
                 "tokenizer.json; gemma: llama.cpp (llama-cpp-python %s) tokenize(add_bos=False, special=True); "
                 "templates: transformers apply_chat_template" % llama_cpp.__version__,
        "smollm2_special_tokens": {"bos_token": smol_tf.bos_token, "eos_token": smol_tf.eos_token,
                                   "pad_token": smol_tf.pad_token},
        "encodings": encodings,
        "smollm2_chats": smol_chats,
        "tiny_chats": tiny_chats,
        "templates": templates,
    }, open(out, "w"), ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:5])
