"""The artifacts' tokenizer without transformers: the `tokenizers` library on the copied
`tokenizer.json`, and chat templates rendered with jinja2 the way Hugging Face renders them.

`dflash-export` copies the target's tokenizer files into `ARTIFACTS/tokenizer/`. Hugging Face's
fast tokenizers are `tokenizers.Tokenizer` objects built from `tokenizer.json`, plus what
`tokenizer_config.json` says about special tokens, added tokens and the chat template; this
module reads the same files and applies the same rules (transformers 5):

- the named special tokens (bos, eos, unk, sep, pad, cls, mask; `extra_special_tokens` /
  `additional_special_tokens`) and `added_tokens_decoder` entries the backend lacks are added
  as special tokens; `special_tokens_map.json` is read only when the config has no
  `added_tokens_decoder` (legacy checkpoints);
- `add_bos_token` / `add_eos_token` in the config are ignored when `tokenizer.json` exists (its
  post-processor decides); a missing post-processor adds nothing; truncation and padding stored
  in `tokenizer.json` are off (HF turns them off for a call that does not ask for them);
  `split_special_tokens` is honoured;
- `decode` cleans up tokenization spaces only when the config asks for it and the model is not
  BPE (where the cleanup would corrupt text);
- the chat template comes from `chat_template.jinja` when present, else the config's
  `chat_template` (a string, or named templates with a "default"); it is rendered in jinja2's
  immutable sandbox with `trim_blocks` / `lstrip_blocks`, the `loopcontrols` extension, HF's
  `tojson` (no HTML escaping), `raise_exception`, `strftime_now`, and the special tokens as
  variables; message keys whose value is None are dropped, as HF does.

Only the interface the runtime, the server and users need is here: `tok(text)["input_ids"]`,
`encode`, `decode`, `convert_ids_to_tokens`, `apply_chat_template`, the special tokens and
their ids. A directory without `tokenizer.json` (only a SentencePiece `tokenizer.model`, or
`vocab.json` + `merges.txt`) needs transformers to convert it: with the `export` extra installed
the runtime falls back to `AutoTokenizer`, otherwise it says so.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")
SPECIAL_TOKENS += ("mask_token",)


class TokenizerError(ValueError):
    """The tokenizer files cannot be read: says which and what to do."""


def _content(value) -> str | None:
    """A special token as the config writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TokenizerError(f"{path} is not readable JSON ({e}): re-export the artifacts") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} is not a JSON object: re-export the artifacts")
    return data


class Tokenizer:
    """A fast tokenizer from a directory holding tokenizer.json (see the module docstring)."""

    def __init__(self, backend, config: dict | None = None, chat_template=None):
        self._tokenizer = backend
        config = dict(config or {})
        # as HF's __call__ without truncation or padding arguments: whole prompts, never padded
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map: dict[str, str] = {}
        for key in SPECIAL_TOKENS:
            tok = _content(config.get(key))
            if tok is not None:
                self.special_tokens_map[key] = tok
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, dict):  # model-specific names (e.g. image_token)
            extra = list(extra.values())
        self.extra_special_tokens = [t for t in map(_content, extra) if t is not None]
        self._add_missing(config)
        for key, tok in self.special_tokens_map.items():
            setattr(self, key, tok)
            setattr(self, f"{key}_id", self._tokenizer.token_to_id(tok))
        for key in SPECIAL_TOKENS:
            if key not in self.special_tokens_map:
                setattr(self, key, None)
                setattr(self, f"{key}_id", None)

    def _add_missing(self, config: dict) -> None:
        """Add the config's added and special tokens that tokenizer.json lacks, as HF does."""
        from tokenizers import AddedToken

        have = {str(t.content) for t in self._tokenizer.get_added_tokens_decoder().values()}
        new = []
        decoder = config.get("added_tokens_decoder") or {}
        for _, tok in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            if isinstance(tok, dict) and tok.get("content") not in have:
                fields = ("single_word", "lstrip", "rstrip", "normalized", "special")
                new.append(AddedToken(tok["content"], **{k: tok[k] for k in fields if k in tok}))
                have.add(tok["content"])
        for tok in [*self.special_tokens_map.values(), *self.extra_special_tokens]:
            if tok not in have:
                new.append(AddedToken(tok, special=True, normalized=False))
                have.add(tok)
        if new:
            self._tokenizer.add_tokens(new)
        if self._tokenizer.post_processor is None:
            from tokenizers import processors

            self._tokenizer.post_processor = processors.TemplateProcessing(
                single="$A:0", pair="$A:0 $B:1", special_tokens=[]
            )

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Read `directory/tokenizer.json` and its companions (see the module docstring)."""
        from tokenizers import Tokenizer as Backend

        d = Path(directory)
        path = d / "tokenizer.json"
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise TokenizerError(f"{path} does not load ({e}): re-export the artifacts") from e
        config = {}
        if (d / "tokenizer_config.json").is_file():
            config = _read_json(d / "tokenizer_config.json")
        if "added_tokens_decoder" not in config and (d / "special_tokens_map.json").is_file():
            legacy = _read_json(d / "special_tokens_map.json")
            config = {**{k: v for k, v in legacy.items() if v}, **config}
        template = config.get("chat_template")
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}
        return cls(backend, config, template)

    # ------------------------------------------------------------------ text <-> ids

    def __call__(self, text, add_special_tokens: bool = True, **kwargs) -> dict:
        """{"input_ids": ids} of one text, or of each text in a list (as HF, without tensors)."""
        if kwargs:
            raise TypeError(
                f"this tokenizer takes text and add_special_tokens only (got {sorted(kwargs)})"
            )
        if isinstance(text, (list, tuple)):
            return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a string (got {type(text).__name__})")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None
    ) -> str:
        if isinstance(ids, int):
            ids = [ids]
        text = self._tokenizer.decode(
            [int(t) for t in ids], skip_special_tokens=skip_special_tokens
        )
        clean = self.clean_up_tokenization_spaces
        if clean_up_tokenization_spaces is not None:
            clean = clean_up_tokenization_spaces
        if clean and type(self._tokenizer.model).__name__ != "BPE":
            text = clean_up_tokenization(text)
        return text

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(t) for t in tokens]

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return [self._tokenizer.token_to_id(t) for t in self.all_special_tokens]

    @property
    def backend_tokenizer(self):
        """The `tokenizers.Tokenizer` underneath (as HF's fast tokenizers name it)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (as HF's `vocab_size`)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ chat

    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError(
                    f"this tokenizer has several chat templates and no default: pass one of "
                    f"{sorted(own)} as chat_template"
                )
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError(
                "this tokenizer has no chat template: pass chat_template (a Jinja template)"
            )
        return own

    def apply_chat_template(
        self,
        conversation: list[dict],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs,
    ):
        """The conversation rendered by the chat template (text, or its ids when tokenize:
        encoded without special tokens, as HF does). kwargs are template variables (e.g.
        enable_thinking=False); they override the special tokens of the same name."""
        template = self.get_chat_template(chat_template, tools)
        if not conversation:
            raise ValueError("the conversation is empty: give at least one message")
        messages = [
            _aliased({k: v for k, v in dict(m).items() if v is not None}) for m in conversation
        ]
        variables = {**self.special_tokens_map, **kwargs}
        text = _compiled(template).render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


_REASONING = ("reasoning_content", "thinking", "reasoning")


def _aliased(message: dict) -> dict:
    """A message's reasoning under the names templates read (HF fills `reasoning_content`
    from the older names, and `thinking` for the templates that read that)."""
    reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def clean_up_tokenization(text: str) -> str:
    """HF's clean-up of spaces before punctuation and contractions (WordPiece-era tokenizers)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")):
        text = text.replace(a, b)
    for a, b in ((" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


_TEMPLATES: dict[str, object] = {}


def _compiled(template: str):
    """A chat template compiled once, in the environment HF renders chat templates in."""
    if template in _TEMPLATES:
        return _TEMPLATES[template]
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class Generation(jinja2.ext.Extension):
        """`{% generation %}…{% endgeneration %}` (HF marks assistant text with it): the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    compiled = env.from_string(template)
    if len(_TEMPLATES) < 16:
        _TEMPLATES[template] = compiled
    return compiled


def load_tokenizer(directory: str | Path):
    """The artifacts' tokenizer: `Tokenizer` over tokenizer.json; without tokenizer.json,
    transformers' `AutoTokenizer` when installed (it converts the other forms)."""
    d = Path(directory)
    if (d / "tokenizer.json").is_file():
        return Tokenizer.from_dir(d)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerError(
            f"{d} has no tokenizer.json (only {', '.join(sorted(f.name for f in d.iterdir()))}): "
            "converting that form needs transformers: pip install 'dflash-qaic[export]', or "
            "load(..., tokenizer=False) and pass token ids"
        ) from None
    log.info("%s has no tokenizer.json: loading it with transformers' AutoTokenizer", d)
    return AutoTokenizer.from_pretrained(d, local_files_only=True)
