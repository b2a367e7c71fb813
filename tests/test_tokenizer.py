"""The runtime's tokenizer (runtime/tokenizer.py: `tokenizers` + jinja2, no transformers) gives
the same ids, text and chat prompts as transformers' AutoTokenizer on the same files: the
built-in pair's byte tokenizer, a Qwen3-form tokenizer with its kind of chat template (a tiny
Qwen3 pair exported with it), a Llama-3-form one (BOS from the post-processor) and a legacy one
(special tokens only in special_tokens_map.json)."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as Backend
from transformers import AutoTokenizer

import dflash_qaic
from dflash_qaic import assets
from dflash_qaic.runtime.tokenizer import Tokenizer, TokenizerError, load_tokenizer

TEXTS = [
    "hello world",
    "naïve café costs 3 € — 😀 ok",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "  two leading spaces, trailing  ",
    "",
    "Ａ full-width ﬁ ligature (NFC / NFKC differ)",
    "don't stop , they 're here .",
]

# A chat template in the Qwen3 form: system + tools block, a namespace scan for the last user
# query, reasoning split out of assistant turns, tool calls as JSON, tool responses, and the
# enable_thinking switch.
QWEN3_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for m in messages[::-1] %}
{%- if m.role == 'user' and ns.last_query == messages|length - 1 %}{%- set ns.last_query = (messages|length - 1) - loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- set content = m.content if m.content is string else '' %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{%- for call in m.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_PLAIN = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added, not special

CONVERSATIONS = [
    [{"role": "user", "content": "Write fib in Python."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3? café ☕"},
    ],
    [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,  # dropped, as HF drops None values
            "reasoning_content": "call the tool",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _corpus() -> list[str]:
    return TEXTS * 4 + ["the quick brown fox jumps over the lazy dog"] * 20


def write_qwen3_tokenizer(d) -> None:
    """tokenizer.json + tokenizer_config.json in the form Qwen3 checkpoints ship."""
    tok = Backend(models.BPE(byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_PLAIN])
    tok.save(str(d / "tokenizer.json"))
    decoder = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in QWEN_SPECIAL,
        }
        for t in QWEN_SPECIAL + QWEN_PLAIN
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": QWEN3_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_llama3_tokenizer(d) -> None:
    """A Llama-3-form tokenizer: the post-processor prepends <|begin_of_text|>."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    tok.save(str(d / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))


def write_legacy_tokenizer(d) -> None:
    """WordPiece without its special tokens in tokenizer.json; they are named only in
    special_tokens_map.json (no added_tokens_decoder in the config); spaces are cleaned up."""
    tok = Backend(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.enable_truncation(max_length=4)  # stored in tokenizer.json; a call without truncation
    tok.enable_padding(length=64)  # or padding arguments uses neither
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": True}))
    smap = {
        "sep_token": "[SEP]",
        "cls_token": {"content": "[CLS]", "lstrip": False},
        "pad_token": "[PAD]",
    }
    (d / "special_tokens_map.json").write_text(json.dumps(smap))


def assert_same(d, conversations=(), **template_kw):
    hf = AutoTokenizer.from_pretrained(d, local_files_only=True)
    ours = Tokenizer.from_dir(d)
    texts = TEXTS + [f"{t} x {t}" for t in hf.all_special_tokens]
    for text in texts:
        for special in (True, False):
            want = hf(text, add_special_tokens=special)["input_ids"]
            assert ours(text, add_special_tokens=special)["input_ids"] == want, (text, special)
            for skip in (True, False):
                assert ours.decode(want, skip_special_tokens=skip) == hf.decode(
                    want, skip_special_tokens=skip
                ), (text, skip)
    assert ours.all_special_ids == hf.all_special_ids
    assert (ours.eos_token, ours.eos_token_id) == (hf.eos_token, hf.eos_token_id)
    assert (ours.bos_token, ours.pad_token_id) == (hf.bos_token, hf.pad_token_id)
    assert len(ours) == len(hf)
    for conv in conversations:
        for gen in (True, False):
            kw = dict(add_generation_prompt=gen, **template_kw)
            want = hf.apply_chat_template(conv, tokenize=False, **kw)
            assert ours.apply_chat_template(conv, tokenize=False, **kw) == want
            ids = hf(want, add_special_tokens=False)["input_ids"]
            assert ours.apply_chat_template(conv, **kw) == ids
    return hf, ours


def test_the_builtin_pair_tokenizer_equals_transformers():
    hf, ours = assert_same(assets.ROOT / "pair" / "target")
    assert ours.chat_template is None and hf.chat_template is None


def test_a_qwen3_tokenizer_and_chat_template_equal_transformers(tmp_path):
    write_qwen3_tokenizer(tmp_path)
    for kw in ({}, {"enable_thinking": False}, {"tools": TOOLS}):
        hf, ours = assert_same(tmp_path, CONVERSATIONS, **kw)
    assert hf.eos_token == "<|im_end|>" and hf.bos_token is None
    # <think> is an added token but not a special one: it survives skip_special_tokens
    ids = ours("<think>x</think><|im_end|>")["input_ids"]
    assert ours.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_a_llama3_and_a_legacy_tokenizer_equal_transformers(tmp_path):
    (tmp_path / "llama").mkdir()
    write_llama3_tokenizer(tmp_path / "llama")
    _, ours = assert_same(tmp_path / "llama", CONVERSATIONS[:2])
    assert ours("hi")["input_ids"][0] == ours.bos_token_id  # from the post-processor
    (tmp_path / "legacy").mkdir()
    write_legacy_tokenizer(tmp_path / "legacy")
    _, ours = assert_same(tmp_path / "legacy")
    assert ours.sep_token_id is not None  # added from special_tokens_map.json
    assert ours.decode(ours("don't stop , ok .")["input_ids"]) == "don't stop, ok."
    assert len(ours(TEXTS[2])["input_ids"]) > 4  # no truncation


def test_named_chat_templates_and_template_errors(tmp_path):
    write_qwen3_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_dir(tmp_path)
    msg = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(msg, tokenize=False) == "Dx"
    assert ours.apply_chat_template(msg, tools=TOOLS, tokenize=False) == "T1"
    assert ours.apply_chat_template(msg, chat_template="tool_use", tools=[], tokenize=False) == "T0"
    # chat_template.jinja beside the config wins, as in transformers
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}{{ eos_token }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(msg, tokenize=False) == "J1<|im_end|>"
    bad = "{{ raise_exception('no system messages') }}"
    with pytest.raises(Exception, match="no system messages"):
        ours.apply_chat_template(msg, chat_template=bad)
    with pytest.raises(Exception, match="unsafe|access"):  # the sandbox holds
        ours.apply_chat_template(msg, chat_template="{{ messages.__class__.__mro__ }}")


def test_without_tokenizer_json(tmp_path, monkeypatch):
    write_qwen3_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "vocab.json").write_text("{}")
    import builtins

    real = builtins.__import__

    def no_transformers(name, *a, **kw):
        if name.startswith("transformers"):
            raise ImportError("No module named 'transformers'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(TokenizerError, match=r"no tokenizer.json.*dflash-qaic\[export\]"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="does not load"):
        load_tokenizer(tmp_path)


def test_a_tiny_qwen3_pair_exported_with_its_tokenizer(tiny_pair, tmp_path):
    """The export copies the tokenizer files; load() reads them without transformers and
    encodes and renders chat prompts as transformers does."""
    target, draft = tiny_pair(family="qwen3", vocab_size=320, target_layer_ids=[0, 3])
    t = tmp_path / "target"
    shutil.copytree(target, t)
    write_qwen3_tokenizer(t)
    out = tmp_path / "art"
    dflash_qaic.export(t, draft, out, ctx_len=256, prefill_seq_len=32, compile=False)
    pipe = dflash_qaic.load(out, threads=1)
    assert type(pipe.tokenizer) is Tokenizer
    hf = AutoTokenizer.from_pretrained(out / "tokenizer", local_files_only=True)
    conv = CONVERSATIONS[1]
    text = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert (
        pipe.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
        == hf(text, add_special_tokens=False)["input_ids"]
    )
    res = pipe.generate(text, 8, [])
    assert res.text == hf.decode(res.tokens)
