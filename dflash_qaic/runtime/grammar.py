"""Structured output on the host: a grammar per request, its token masks per verify row, the
proposals it forces or cuts (docs/DESIGN.md, Structured output).

The grammars are xgrammar's (the `structured` extra): `Grammars` compiles a request's
`response_format` once per distinct spec (cached) against the artifacts' tokenizer, and each
sequence gets a `Constraint`, one `GrammarMatcher` holding the state after its committed tokens.
Before a verify call the matcher walks the draft's proposals, writing the mask of every row
(row i: the tokens allowed after the anchor and proposals 0 … i − 1), replacing a proposal by
the one token the grammar allows where it allows exactly one (filling), and stopping at the
first proposal it rejects (the cut: that proposal and those after it get confidence 0, so no
verify row is spent on them); it is then rolled back, and advanced by the tokens the step
commits. The target chooses under the masks on the device, so every committed token is one the
grammar allows: the output is the target's own under the same constraint.

A response format is a dict, the same for `generate(..., response_format=...)` and the server:

    {"type": "text"}                                         no constraint
    {"type": "json_object"}                                  any JSON object
    {"type": "json_schema", "json_schema": {"schema": {…}}}  OpenAI's form (name, strict ignored)
    {"type": "regex", "regex": "…"}                          vLLM's structured_outputs, by kind
    {"type": "choice", "choice": ["…", …]}
    {"type": "grammar", "grammar": "root ::= …"}             EBNF (xgrammar's, GBNF-like)

JSON is generated compact (no free whitespace: a small model left free to emit whitespace can
loop on it, and fixed separators make a schema's keys and punctuation forced tokens).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict

import numpy as np

from dflash_qaic import contract

KINDS = ("text", "json_object", "json_schema", "regex", "choice", "grammar")
INSTALL = "pip install 'dflash-qaic[structured]'"


class GrammarError(ValueError):
    """A response format that cannot be compiled or satisfied: says which and why."""


#: the most alternatives one constraint may hold (enum and const values, choices, anyOf and
#: oneOf branches, a regex's or an EBNF grammar's `|`): xgrammar's compile time grows with
#: their square (a 60,000-value enum: minutes), so more are refused before compiling
MAX_ALTERNATIVES = 10_000

#: JSON-Schema keywords xgrammar accepts but does not enforce (its output may break them),
#: each with what to do instead; a schema using one is refused unless compiled leniently
UNENFORCED = {
    "not": "xgrammar does not enforce it: describe the allowed values positively",
    "uniqueItems": "xgrammar does not enforce it (an array may repeat an item): drop it, or "
    "check the answer",
    "if": "conditional schemas are not enforced: use anyOf of the cases",
    "then": "conditional schemas are not enforced: use anyOf of the cases",
    "else": "conditional schemas are not enforced: use anyOf of the cases",
    "dependentRequired": "it is not enforced: use anyOf of the object's forms",
    "dependentSchemas": "it is not enforced: use anyOf of the object's forms",
    "dependencies": "it is not enforced: use anyOf of the object's forms",
    "contains": "it is not enforced: use prefixItems or items",
    "minContains": "it is not enforced: use prefixItems or items",
    "maxContains": "it is not enforced: use prefixItems or items",
    "$dynamicRef": "it is not supported: use $ref",
    "$recursiveRef": "it is not supported: use $ref",
}
#: keywords whose values are subschemas, a list of them, or a name -> subschema map
_SUB = {
    "items",
    "additionalProperties",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
    "not",
    "contains",
    "if",
    "then",
    "else",
}
_SUBS = {"allOf", "anyOf", "oneOf", "prefixItems"}
_SUBMAP = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def schema_problems(schema) -> list[str]:
    """What of a JSON schema xgrammar would not enforce, one sentence each naming the keyword
    (empty: every keyword it holds is enforced, or is an annotation)."""
    out: list[str] = []
    _walk(schema, "#", out)
    return out


def _walk(node, where: str, out: list[str]) -> None:
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in UNENFORCED and not (key == "uniqueItems" and value is False):
            out.append(
                f"the JSON-Schema keyword {key!r} at {where} is not enforced: {UNENFORCED[key]}"
            )
        if key in _SUB:
            _walk(value, f"{where}/{key}", out)
        elif key in _SUBS and isinstance(value, list):
            for i, sub in enumerate(value):
                _walk(sub, f"{where}/{key}/{i}", out)
        elif key in _SUBMAP and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{where}/{key}/{name}", out)
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        out.append(
            f"the JSON-Schema keyword 'allOf' at {where} has {len(all_of)} schemas, and "
            "xgrammar enforces only one: merge them into one schema"
        )
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint_types(one_of):
        out.append(
            f"the JSON-Schema keyword 'oneOf' at {where} has branches that are not told "
            "apart by their type, so exactly-one is not enforced: use anyOf"
        )
    out.extend(_required_forbidden(node, where))


def _disjoint_types(branches: list) -> bool:
    """Every branch declares its types and no value has two branches' types."""
    seen: set[str] = set()
    for b in branches:
        t = b.get("type") if isinstance(b, dict) else None
        types = {t} if isinstance(t, str) else set(t or ())
        if "number" in types:
            types.add("integer")  # an integer is a number
        if not types or types & seen:
            return False
        seen |= types
    return True


def _required_forbidden(node: dict, where: str) -> list[str]:
    """Required keys that additionalProperties: false forbids (no object can satisfy them)."""
    if node.get("additionalProperties") is not False:
        return []
    props, patterns = node.get("properties") or {}, node.get("patternProperties") or {}
    out = []
    for key in node.get("required") or ():
        if key in props or any(_search(p, key) for p in patterns):
            continue
        out.append(
            f"the JSON-Schema keyword 'required' at {where} names {key!r}, which "
            "'additionalProperties': false forbids (it is not among 'properties'): no "
            "answer can satisfy both, so add it to 'properties' or drop it from 'required'"
        )
    return out


def _search(pattern: str, key: str) -> bool:
    try:
        return re.search(pattern, key) is not None
    except re.error:
        return True  # xgrammar will say what is wrong with the pattern


def alternatives(spec: dict) -> int:
    """How many alternatives a normalized spec holds (see MAX_ALTERNATIVES)."""
    kind = spec["type"]
    if kind == "choice":
        return len(spec["choice"])
    if kind in ("regex", "grammar"):
        return spec[kind].count("|") + 1
    if kind != "json_schema":
        return 1
    count, stack = 0, [spec["schema"]]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            count += len(node["enum"]) if isinstance(node.get("enum"), list) else 0
            count += "const" in node
            for key in ("anyOf", "oneOf"):
                count += len(node[key]) if isinstance(node.get(key), list) else 0
            stack.extend(
                v for k, v in node.items() if k not in ("enum", "const", "default", "examples")
            )
        elif isinstance(node, list):
            stack.extend(node)
    return count


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise GrammarError(
            f"structured output needs the xgrammar package, which is not installed: {INSTALL}"
        ) from e
    return xgrammar


def tokenizer_info(xgr, tokenizer, vocab_size: int, stop_ids):
    """xgrammar's TokenizerInfo from the artifacts' tokenizer (runtime/tokenizer.py: a
    `tokenizers.Tokenizer` underneath, no transformers): its encoded vocabulary by id, the
    vocabulary type and prefix space as xgrammar reads them from tokenizer.json, special added
    tokens as empty strings (xgrammar never allows an empty token inside a grammar), and the
    artifacts' EOS ids as stop tokens."""
    backend = tokenizer.backend_tokenizer
    encoded = [""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = token
    for i, added in backend.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            encoded[i] = ""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    vocab_type = meta["vocab_type"]
    if not isinstance(vocab_type, xgr.VocabType):
        vocab_type = xgr.VocabType(vocab_type)
    return xgr.TokenizerInfo(
        encoded,
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(stop_ids),
        add_prefix_space=bool(meta["add_prefix_space"]),
    )


def normalize(response_format) -> dict | None:
    """The response format checked for its shape (GrammarError naming the problem); None for
    no constraint (None or {"type": "text"})."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError(
            f"response_format must be a dict such as {{'type': 'json_object'}}, got "
            f"{type(response_format).__name__}"
        )
    kind = response_format.get("type")
    if kind not in KINDS:
        raise GrammarError(f"response_format type must be one of {list(KINDS)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": kind}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError(
                "response_format json_schema needs 'json_schema': {'name': …, 'schema': {…}}"
            )
        schema = spec.get("schema", spec.get("json_schema"))
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the JSON schema ('json_schema': {'schema': …}) must be an object")
        return {"type": kind, "schema": schema}
    value = response_format.get(kind)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarError("a choice constraint needs a non-empty list of strings")
        return {"type": kind, "choice": list(value)}
    if not isinstance(value, str) or not value:
        raise GrammarError(f"a {kind} constraint needs a non-empty string")
    return {"type": kind, kind: value}


class Grammars:
    """Compiled grammars of one tokenizer, cached per spec (compiling a schema costs
    milliseconds to seconds; a matcher from a compiled grammar costs microseconds)."""

    CACHE = 256

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self.xgr = _xgrammar()
        if tokenizer is None or getattr(tokenizer, "backend_tokenizer", None) is None:
            raise GrammarError(
                "structured output needs the artifacts' tokenizer (a tokenizer.json), and these "
                "artifacts have none"
            )
        self.info = tokenizer_info(self.xgr, tokenizer, vocab_size, stop_ids)
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=1)
        self.vocab_size, self.words = vocab_size, contract.bitmask_words(vocab_size)
        self.stop_ids = frozenset(stop_ids)
        self.json_row = _json_row(self.info, vocab_size)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles on its tokenizing threads

    def compile(
        self, response_format, lenient: bool = False, max_alternatives: int | None = None
    ) -> Grammar | None:
        """The grammar of a response format (None: no constraint); GrammarError when it is
        malformed, holds more than `max_alternatives`, uses a JSON-Schema keyword xgrammar does
        not enforce (lenient: accepted, the reasons in `Grammar.warnings`), uses what xgrammar
        does not support, or the vocabulary cannot begin it. max_alternatives: None for
        MAX_ALTERNATIVES."""
        spec = normalize(response_format)
        if spec is None:
            return None
        warnings = self.check(spec, lenient, max_alternatives or MAX_ALTERNATIVES)
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return Grammar(self, compiled, warnings, spec["type"])
        compiled = self._compile(spec)
        grammar = Grammar(self, compiled, warnings, spec["type"])
        probe = np.zeros((1, self.words), np.int32)
        grammar.matcher().fill_next_token_bitmask(probe, 0)
        if not probe.any():
            raise GrammarError(
                f"no token of this model's vocabulary can begin the {spec['type']} constraint: "
                "it cannot be satisfied"
            )
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.CACHE:
                self._cache.popitem(last=False)
        return grammar

    @staticmethod
    def check(spec: dict, lenient: bool = False, most: int = MAX_ALTERNATIVES) -> list[str]:
        """Before compiling: the size bound (GrammarError) and the schema's keywords
        (GrammarError naming the first one not enforced; lenient: their sentences returned)."""
        n = alternatives(spec)
        if n > most:
            raise GrammarError(
                f"the {spec['type']} constraint holds {n} alternatives (enum and const values, "
                f"choices, anyOf/oneOf branches, '|'), more than the {most} "
                "compiled here (compile time grows with their square): use fewer, or raise the "
                "limit (dflash-serve --max-grammar-alternatives)"
            )
        problems = schema_problems(spec["schema"]) if spec["type"] == "json_schema" else []
        if problems and not lenient:
            raise GrammarError(
                f"{problems[0]} (dflash-serve --structured-output-lenient accepts such schemas "
                "unenforced)"
            )
        return problems

    def _compile(self, spec: dict):
        c, kind = self.compiler, spec["type"]
        try:
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "json_schema":
                return c.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(spec["regex"])
            if kind == "choice":
                return c.compile_grammar(choice_grammar(spec["choice"]))
            return c.compile_grammar(spec["grammar"])
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its reason
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            reason = re.sub(
                r"^(\[[^]]*\] )?\S+:\d+: ", "", reason
            )  # xgrammar's "[time] file:line: "
            raise GrammarError(f"the {kind} constraint cannot be compiled: {reason}") from None


def _json_row(info, vocab_size: int) -> np.ndarray:
    """The mask row of the tokens JSON may hold: xgrammar's JSON strings admit raw control
    characters (U+0000 to U+001F but the line ends), which strict JSON forbids (they are written
    \\u00XX), and compact JSON has no whitespace outside strings; so no token with one."""
    bits = np.ones(contract.bitmask_words(vocab_size) * 32, np.uint8)
    for i, token in enumerate(info.decoded_vocab[:vocab_size]):
        if token and min(token) < 0x20:
            bits[i] = 0
    return np.packbits(bits, bitorder="little").view(np.int32)


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of the strings (JSON string escapes are xgrammar's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammar:
    """A compiled grammar: each sequence constrained by it gets its own matcher."""

    def __init__(self, grammars: Grammars, compiled, warnings=None, kind: str = "grammar"):
        self.grammars, self.compiled = grammars, compiled
        self.warnings = warnings or []  # what of a leniently compiled schema is not enforced
        self.json = kind in ("json_object", "json_schema")

    def matcher(self):
        return self.grammars.xgr.GrammarMatcher(self.compiled)

    def constraint(self) -> Constraint:
        allowed = self.grammars.json_row if self.json else None
        return Constraint(self.matcher(), self.grammars.words, allowed)


class Constraint:
    """One sequence's grammar state: the matcher after its committed tokens, and counts of what
    it did (forced and cut proposals, host seconds)."""

    def __init__(self, matcher, words: int, allowed: np.ndarray | None = None):
        self.m, self.words = matcher, words
        self.allowed_row = allowed  # tokens the grammar may ever allow (None: all)
        self.advanced = 0  # proposals accepted into the matcher since the last commit
        self.forced = 0  # proposals replaced by the one token the grammar allowed
        self.cut = 0  # proposals cut because the grammar rejected them (or one before them)
        self.host_s = 0.0  # CPU seconds (this thread) in the matcher, the masks and the filling

    @property
    def terminated(self) -> bool:
        return self.m.is_terminated()

    def mask(self, row: np.ndarray) -> None:
        """The next token's mask ([words] int32) after the committed tokens."""
        t = time.thread_time()
        self._fill(row[None], 0)
        self.host_s += time.thread_time() - t

    def _fill(self, masks: np.ndarray, i: int) -> None:
        if self.m.is_terminated():  # only a stop token was left, and it was taken
            masks[i] = -1
        else:
            self._fill_row(masks, i)

    def propose(self, proposals: np.ndarray, confidence: np.ndarray, masks: np.ndarray, fill: bool):
        """Masks of the verify rows for these proposals ([B − 1] each, changed in place) into
        masks [B, words]: row i is the state after proposals 0 … i − 1. Where the grammar allows
        one token it replaces the proposal (`fill`); the first proposal the grammar rejects and
        all after it get confidence 0 and all-ones masks (their rows are never accepted: the
        row before them chooses an allowed token, which differs from the rejected one)."""
        t = time.thread_time()
        m, n = self.m, len(proposals)
        accept, ended, fill_row = m.accept_token, m.is_terminated, self._fill_row
        accepted = 0
        for i, d in enumerate(proposals.tolist() + [None]):
            if ended():  # the grammar took its stop token: nothing can follow
                masks[i:] = -1
                self.cut += n - i
                confidence[i:] = 0.0
                break
            fill_row(masks, i)
            if d is None:
                break
            row = int.from_bytes(masks[i].tobytes(), "little")  # bit t = token t allowed
            if fill and row and not row & (row - 1):  # exactly one token: it is forced
                one = row.bit_length() - 1
                if one != d:
                    proposals[i] = d = one
                    self.forced += 1
            if not (row >> d) & 1 or not accept(d):
                confidence[i:] = 0.0
                masks[i + 1 :] = -1
                self.cut += n - i
                break
            accepted += 1
        self.advanced = accepted
        self.host_s += time.thread_time() - t

    def _fill_row(self, masks: np.ndarray, i: int) -> None:
        self.m.fill_next_token_bitmask(masks, i)
        if self.allowed_row is not None:
            masks[i] &= self.allowed_row

    def advance(self, tokens) -> None:
        """The tokens a step committed: undo the proposals, accept these."""
        t = time.thread_time()
        if self.advanced:
            self.m.rollback(self.advanced)
            self.advanced = 0
        for tok in tokens:
            if self.m.is_terminated():
                break
            if not self.m.accept_token(int(tok)):
                raise RuntimeError(
                    f"the grammar rejected committed token {int(tok)}: the target program did "
                    "not apply the token bitmask (re-export with --structured-output)"
                )
        self.host_s += time.thread_time() - t

    def stats(self, steps: int) -> dict:
        return {
            "forced_proposals": self.forced,
            "cut_proposals": self.cut,
            "grammar_host_s": self.host_s,
            "grammar_host_ms_per_step": 1e3 * self.host_s / max(steps, 1),
        }


class StepMasks:
    """The step's side of structured output (runtime/step.py calls it): the masks of the
    constrained rows of each call, written from their sequences' matchers, and the rows of a
    slot reset to all ones once no constrained sequence holds it. Rows without a grammar cost
    nothing per step (their masks stay all ones); a program without the bitmask input has none.

    fill: replace a proposal by the one token the grammar allows where it allows one (switch
    it off to measure what filling gains)."""

    def __init__(self, state, calls: list, block_size: int, fill: bool = True):
        self.state, self.fill = state, fill
        self.calls = [c for c in calls if c.mask is not None]
        self.on = bool(self.calls)
        self.scratch = None
        if self.on:
            rows, words = self.calls[0].mask.shape[0], self.calls[0].mask.shape[2]
            self.scratch = np.full((rows, block_size, words), -1, np.int32)
        self.dirty: set[int] = set()  # slots whose rows in some call hold a grammar's masks

    def _constrained(self, seqs) -> list:
        cons = [s for s in seqs if s.constraint is not None]
        if self.dirty:  # slots a constrained sequence left: all ones again
            for r in self.dirty - {s.slot for s in cons}:
                for c in self.calls:
                    c.mask[r] = -1
                self.dirty.discard(r)
        return cons

    def propose(self, seqs) -> list:
        """Before a verify length is chosen: each constrained row's masks for its proposals
        (filled and cut in place, `Constraint.propose`). Returns the constrained sequences."""
        cons = self._constrained(seqs)
        st = self.state
        for seq in cons:
            r = seq.slot
            seq.constraint.propose(st.proposals[r], st.confidence[r], self.scratch[r], self.fill)
        return cons

    def verify(self, cons: list, call, n: int) -> None:
        """The verify call of n rows: the constrained rows' first n masks."""
        for seq in cons:
            r = seq.slot
            call.mask[r] = self.scratch[r, :n]
            self.dirty.add(r)

    def decode(self, seqs, call) -> None:
        """A decode call (the target alone): each constrained row's next-token mask."""
        for seq in self._constrained(seqs):
            seq.constraint.mask(call.mask[seq.slot, 0])
            self.dirty.add(seq.slot)


class TokenSet:
    """A fixed set of allowed tokens (vLLM's `allowed_token_ids`): every row's mask is the set,
    with no state; the grammar's interface, so the step treats it alike."""

    def __init__(self, ids, vocab_size: int):
        words = contract.bitmask_words(vocab_size)
        bits = np.zeros(words * 32, np.uint8)
        ids = sorted({int(t) for t in ids})
        if not ids or ids[0] < 0 or ids[-1] >= vocab_size:
            raise GrammarError(f"allowed_token_ids must be token ids in 0 … {vocab_size - 1}")
        bits[ids] = 1
        self.row = np.packbits(bits, bitorder="little").view(np.int32)
        self.single = ids[0] if len(ids) == 1 else -1

    def constraint(self) -> FixedConstraint:
        return FixedConstraint(self)


class FixedConstraint(Constraint):
    def __init__(self, tokens: TokenSet):
        super().__init__(None, len(tokens.row))
        self.tokens = tokens
        self.allowed = np.unpackbits(tokens.row.view(np.uint8), bitorder="little").astype(bool)

    @property
    def terminated(self) -> bool:
        return False

    def mask(self, row: np.ndarray) -> None:
        row[:] = self.tokens.row

    def propose(self, proposals, confidence, masks, fill: bool):
        t = time.thread_time()
        masks[:] = self.tokens.row
        if fill and self.tokens.single >= 0:
            self.forced += int((proposals != self.tokens.single).sum())
            proposals[:] = self.tokens.single
        bad = np.flatnonzero(~self.allowed[proposals])
        if len(bad):
            i = int(bad[0])
            confidence[i:] = 0.0
            self.cut += len(proposals) - i
        self.host_s += time.thread_time() - t

    def advance(self, tokens) -> None:
        pass
