"""The export and compile options, each declared once (its type, default, range and help).

`ExportOptions` is the table: one dataclass field per option, its `Option` in the field's
metadata. From it come the `dflash-export` flags (`add_arguments`), the keyword arguments of
`dflash_qaic.export(...)` / `dflash_qaic.compile(...)` (`ExportOptions.from_kwargs`,
`compile_overrides`), the recipe keys (`RECIPE_OPTIONS`) and every check of a value
(`check`): a bad value is an `ExportError` naming the flag and the Python keyword.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from dflash_qaic import contract
from dflash_qaic.compiler.profiles import MAX_CORES_PER_DEVICE, MAX_DEVICES, CompileOverrides

MAX_CTX_LEN = 1 << 18  # 262144 slots: beyond any supported model's context
MAX_BLOCK_SIZE = 1024
MAX_BATCH_SIZE = 1024


class ExportError(ValueError):
    """Bad export options or inputs: says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Option:
    """How one option is typed, bounded, shown and used.

    kind: "int" | "ints" (a comma-separated list on the command line) | "bool" | "seconds" |
    "str"; lo / hi: the range of an int (of each entry of ints); group: "program" (changes the
    exported programs: part of the reuse key), "run" (how the export runs) or "compile" (a
    compile option, also taken by `dflash_qaic.compile`, overriding the profile); recipe: a
    recipe YAML key too; flag: the command-line flag (default `--<name>`, `--no-<name>` for a
    bool that defaults to True)."""

    kind: str
    help: str
    group: str = "program"
    lo: int | None = None
    hi: int | None = None
    recipe: bool = False
    flag: str | None = None

    def cli_flag(self, name: str, default: Any) -> str:
        if self.flag:
            return self.flag
        dashed = name.replace("_", "-")
        return f"--no-{dashed}" if self.kind == "bool" and default is True else f"--{dashed}"


def _opt(default, kind: str, help: str, **kw):
    meta = Option(kind, help, **kw)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"option": meta})
    return field(default=default, metadata={"option": meta})


def tree_refusal(logprobs: int, extended_sampling: bool) -> str | None:
    """Why tree verification cannot take these options (None: it can): a tree's rows are
    branches, not one sequence (docs/DESIGN.md, Logprobs and Extended sampling)."""
    given = [f for f, on in (("--logprobs", logprobs), ("--extended-sampling", extended_sampling))
             if on]  # fmt: skip
    if not given:
        return None
    flags = " and ".join(given)
    return (
        f"tree verification (--tree-budgets) with {flags} is not built: a tree verify's rows "
        f"are branches, not one sequence, so a row has no single history to adjust by and the "
        f"accepted path's logprobs no order; export without --tree-budgets (chain and block "
        f"verification take {flags}) or without {flags}"
    )


@dataclass(frozen=True)
class ExportOptions:
    """Every option of an export (see the module docstring); None: the default it names."""

    block_size: int | None = _opt(
        None, "int", "draft block B (default: the draft's)", lo=2, hi=MAX_BLOCK_SIZE, recipe=True
    )
    num_speculative_tokens: int | None = _opt(
        None,
        "int",
        "proposals per step, as QEfficient and vLLM say it (= block size - 1)",
        group="alias",
        lo=1,
        hi=MAX_BLOCK_SIZE - 1,
    )
    prefill_seq_len: int = _opt(
        128,
        "int",
        "prefill chunk C (a C/4 chunk beside it when C/4 > the block size)",
        lo=1,
        hi=MAX_CTX_LEN,
        recipe=True,
    )
    ctx_len: int = _opt(4096, "int", "context length in slots", lo=4, hi=MAX_CTX_LEN, recipe=True)
    batch_size: int = _opt(1, "int", "batch size", lo=1, hi=MAX_BATCH_SIZE, recipe=True)
    full_batch_size: int | None = _opt(
        None,
        "int",
        "continuous batching: N sequences at once (QEfficient's name; default: off)",
        lo=1,
        hi=MAX_BATCH_SIZE,
        recipe=True,
    )
    comp_ctx_lengths: tuple[int, ...] | None = _opt(
        None,
        "ints",
        "attention windows, e.g. 512,1024,2048,4096 (must end at --ctx-len; default: ctx/8, "
        "ctx/4, ctx/2, ctx)",
        lo=1,
        hi=MAX_CTX_LEN,
        recipe=True,
    )
    verify_lengths: tuple[int, ...] | None = _opt(
        None,
        "ints",
        "verify calls' row counts, e.g. 4,8,16 (must end at the block size; default: B/4, B/2, "
        "B); B alone compiles the fewest specializations",
        lo=1,
        hi=MAX_BLOCK_SIZE,
        recipe=True,
    )
    emit_logits: bool = _opt(False, "bool", "also output full logits")
    sampling: bool = _opt(
        True, "bool", "greedy-only target program (no on-device sampler: cheaper verify calls)"
    )
    structured_output: bool = _opt(
        False,
        "bool",
        "structured output: the target takes a token bitmask per row (a grammar's allowed "
        "tokens, applied before its token choice; docs/DESIGN.md, Structured output)",
        recipe=True,
    )
    logprobs: int = _opt(
        0,
        "int",
        "the target also returns, per row, the log-probability of its choice and of the K most "
        "likely tokens (K ≤ 20; logprobs and prompt logprobs; docs/DESIGN.md, Logprobs; 0: off)",
        lo=0,
        hi=contract.MAX_LOGPROBS,
        recipe=True,
    )
    logprobs_mode: str = _opt(
        contract.RAW_LOGPROBS,
        "str",
        "which distribution --logprobs reports: raw_logprobs (the target's logits) or "
        "processed_logprobs (after the grammar's mask and the temperature)",
        recipe=True,
    )
    extended_sampling: bool = _opt(
        False,
        "bool",
        "the target takes repetition / presence / frequency penalties, min_p, logit_bias, "
        "min_tokens and bad words per row, applied before every row's choice from the "
        "request's history and the block's own proposals (docs/DESIGN.md, Extended sampling)",
        recipe=True,
    )
    verify_rule: str = _opt(
        contract.CHAIN,
        "str",
        "how a sampled verify accepts: chain (token by token) or block (jointly, Sun et al. "
        "2024; a DFlash draft then samples its proposals from its top-8; docs/DESIGN.md, Block "
        "verification)",
        recipe=True,
    )
    tree_budgets: tuple[int, ...] | None = _opt(
        None,
        "ints",
        "tree verification: the rows of the tree verify calls, e.g. 16,32,64 (a best-first tree "
        "over the draft's top-k per position, verified in one call; dense targets; the draft "
        "then returns its top-k, 8 unless --draft-top-k says; docs/DESIGN.md, Tree "
        "verification); default: none (chains only)",
        lo=2,
        hi=contract.MAX_TREE_BUDGET,
        recipe=True,
    )
    draft_top_k: int = _opt(
        0,
        "int",
        "the draft also returns each proposal row's k most likely ids and log-probabilities "
        "(k ≤ 8; what a tree is built from; 0: off)",
        lo=0,
        hi=contract.MAX_DRAFT_TOP_K,
        recipe=True,
    )
    draft_context_window: int | None = _opt(
        None,
        "int",
        "the draft's full layers attend only to the last N target-feature positions (a ring "
        "cache of N + 1 slots: the draft's cost stops growing with the context; lossless, the "
        "target verifies); default: all of them",
        lo=1,
        hi=MAX_CTX_LEN,
        recipe=True,
    )
    fp16_check: bool = _opt(True, "bool", "skip the fp16 graph run")
    compile: bool = _opt(True, "bool", "export ONNX only", group="run")
    qpc_config: str = _opt(
        "ai100_fp16",
        "str",
        "qpc_configs/<name>.yaml (or a name); default: the recipe's or ai100_fp16",
        group="run",
        recipe=True,
    )
    num_cores: int | None = _opt(
        None,
        "int",
        "the target's AI100 cores per device",
        group="compile",
        lo=1,
        hi=MAX_CORES_PER_DEVICE,
    )
    num_devices: int | None = _opt(
        None, "int", "slice the target over N devices", group="compile", lo=1, hi=MAX_DEVICES
    )
    mos: int | None = _opt(
        None,
        "int",
        "maximum output channel split (-mos)",
        group="compile",
        lo=1,
        hi=MAX_CORES_PER_DEVICE,
    )
    mxfp6_matmul: bool | None = _opt(None, "bool", "MXFP6 MatMul weights", group="compile")
    mxint8_kv_cache: bool | None = _opt(None, "bool", "MXINT8 KV cache", group="compile")
    aic_enable_depth_first: bool | None = _opt(
        None, "bool", "depth-first scheduling", group="compile"
    )
    compile_timeout: float | None = _opt(
        None, "seconds", "seconds per compiler run (default: the profile's)", group="compile"
    )

    def __post_init__(self):
        for f in fields(self):
            value = check(f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        n = self.num_speculative_tokens
        if n is not None:  # B = N + 1, folded into block_size
            if self.block_size is not None and self.block_size != n + 1:
                raise ExportError(
                    f"--block-size {self.block_size} and --num-speculative-tokens {n} "
                    f"disagree (block size = speculative tokens + 1): give one of them"
                )
            object.__setattr__(self, "block_size", n + 1)
            object.__setattr__(self, "num_speculative_tokens", None)
        if self.verify_rule not in contract.RULES:
            raise ExportError(
                f"--verify-rule must be one of {', '.join(contract.RULES)}, got "
                f"{self.verify_rule!r} (`verify_rule=` in Python)"
            )
        if self.logprobs_mode not in contract.LOGPROBS_MODES:
            raise ExportError(
                f"--logprobs-mode must be one of {', '.join(contract.LOGPROBS_MODES)}, got "
                f"{self.logprobs_mode!r} (`logprobs_mode=` in Python)"
            )
        if self.extended_sampling and not self.sampling:
            raise ExportError("--extended-sampling needs the sampler: leave out --no-sampling")
        self._check_tree()
        w = self.comp_ctx_lengths
        if w is not None and (list(w) != sorted(set(w)) or w[-1] != self.ctx_len):
            raise ExportError(
                f"--comp-ctx-lengths must be distinct ascending integers ending at --ctx-len "
                f"{self.ctx_len}, got {list(w)!r}: e.g. {self.ctx_len // 4},{self.ctx_len // 2},"
                f"{self.ctx_len}"
            )

    def _check_tree(self) -> None:
        """--tree-budgets makes the verify rule `tree` and the draft return its top-k."""
        if not self.tree_budgets:
            if self.verify_rule == contract.TREE:
                raise ExportError("--verify-rule tree needs --tree-budgets, e.g. 16,32,64")
            return
        if self.verify_rule == contract.BLOCK:
            raise ExportError(
                "--tree-budgets and --verify-rule block are two verifiers: give one of them "
                "(a tree program verifies chains too)"
            )
        object.__setattr__(self, "verify_rule", contract.TREE)
        why = tree_refusal(self.logprobs, self.extended_sampling)
        if why is not None:  # refused before anything is read
            raise ExportError(why)
        if not self.draft_top_k:
            object.__setattr__(self, "draft_top_k", contract.MAX_DRAFT_TOP_K)

    @classmethod
    def from_kwargs(cls, kwargs: dict, groups=("program", "run", "compile", "alias")):
        """Options from keyword arguments (`dflash_qaic.export`): an unknown name is a
        TypeError listing the known ones."""
        known = names(groups)
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; known: {', '.join(known)}")
        return cls(**kwargs)

    def program_options(self, block_size: int) -> dict:
        """The options that change the exported programs (part of the reuse key)."""
        d = {k: v for k, v in asdict(self).items() if _meta(k).group == "program"}
        d.update(block_size=block_size)
        for k in ("comp_ctx_lengths", "verify_lengths"):  # as JSON has them (the reuse key)
            d[k] = list(d[k]) if d[k] is not None else None
        offs = (("logprobs", 0), ("logprobs_mode", contract.RAW_LOGPROBS))
        for k, off in (*offs, ("extended_sampling", False)):
            if d[k] == off:  # absent when off: the keys of programs exported before they existed
                del d[k]
        if d["tree_budgets"] is None:  # absent: keys of programs exported before it existed
            del d["tree_budgets"]
        else:
            d["tree_budgets"] = list(d["tree_budgets"])
        if d["draft_context_window"] is None:  # the same
            del d["draft_context_window"]
        return d

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @property
    def compile_overrides(self) -> CompileOverrides:
        return compile_overrides(self)

    def shape_plan(self, block_size: int):
        """The shapes both programs are specialized for (`contract.ShapePlan`): the windows
        (default `contract.default_comp_ctx_lengths`), verify and prefill lengths these options
        ask for. The export builds its programs from it; `dflash-bench --project` counts a
        recipe's specializations with it."""
        from dflash_qaic import contract

        B = block_size
        windows = contract.windows_or_default(
            self.comp_ctx_lengths, self.ctx_len, self.prefill_seq_len, B
        )
        return contract.shape_plan(
            B,
            self.prefill_seq_len,
            self.ctx_len,
            batch_size=self.batch_size,
            full_batch_size=self.full_batch_size,
            windows=windows,
            verify_lengths=self.verify_lengths and list(self.verify_lengths),
            sampling=self.sampling,
            tree_budgets=list(self.tree_budgets or ()),
        )


def _meta(name: str) -> Option:
    return _FIELDS[name].metadata["option"]


_FIELDS = {f.name: f for f in fields(ExportOptions)}
RECIPE_OPTIONS = tuple(n for n, f in _FIELDS.items() if f.metadata["option"].recipe)


def names(groups=("program", "run", "compile", "alias")) -> list[str]:
    return [n for n in _FIELDS if _meta(n).group in groups]


def default(name: str) -> Any:
    f = _FIELDS[name]
    return f.default if f.default is not MISSING else f.default_factory()


def flag(name: str) -> str:
    return _meta(name).cli_flag(name, default(name))


def check(name: str, value: Any) -> Any:
    """The value of option `name`, checked against its declaration (lists become tuples);
    ExportError naming the flag and the keyword otherwise."""
    o = _meta(name)
    where = f"--{name.replace('_', '-')}"
    if value is None and default(name) is None:
        return None

    def bad(what: str):
        raise ExportError(f"{where} must be {what}, got {value!r} (`{name}=` in Python)")

    if o.kind == "bool":
        if not isinstance(value, bool):
            bad("True or False")
    elif o.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not o.lo <= value <= o.hi:
            bad(f"an integer in [{o.lo}, {o.hi}]")
    elif o.kind == "ints":
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            bad("a list of integers")
        value = tuple(value)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in value):
            bad("integers, e.g. 4,8,16")
        if not value or not all(o.lo <= n <= o.hi for n in value):
            bad(f"a non-empty list of integers in [{o.lo}, {o.hi}]")
    elif o.kind == "seconds":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not 0 < value or not math.isfinite(value):
            bad("a number of seconds > 0")
        value = float(value)
    elif o.kind == "str":
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            bad("a name or a path")
        value = str(value)
    return value


def compile_overrides(options: ExportOptions | dict) -> CompileOverrides:
    """The compile-group options as the compile step takes them (None: the profile's)."""
    get = options.get if isinstance(options, dict) else lambda k: getattr(options, k)
    return CompileOverrides(
        num_cores=get("num_cores"),
        mxfp6_matmul=get("mxfp6_matmul"),
        mxint8_kv_cache=get("mxint8_kv_cache"),
        num_devices=get("num_devices"),
        mos=get("mos"),
        aic_enable_depth_first=get("aic_enable_depth_first"),
        timeout_s=get("compile_timeout"),
    )


def compile_kwargs(kwargs: dict) -> tuple[str | None, CompileOverrides]:
    """(qpc_config, overrides) from `dflash_qaic.compile`'s keyword arguments, each checked."""
    allowed = ["qpc_config", *names(("compile",))]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(f"unknown compile option(s) {unknown}; known: {', '.join(allowed)}")
    checked = {k: check(k, v) if v is not None else None for k, v in kwargs.items()}
    return checked.get("qpc_config"), compile_overrides(checked)


# ---------------------------------------------------------------------------------------------
# the command line


def _cli_type(name: str, o: Option):
    def parse(text: str):
        try:
            if o.kind == "int":
                value = int(text)
            elif o.kind == "ints":
                value = tuple(int(x) for x in text.split(","))
            elif o.kind == "seconds":
                value = float(text)
            else:
                value = text
        except ValueError:
            what = {"int": "an integer", "ints": "a comma-separated list of integers"}
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {what.get(o.kind, 'a number of seconds')}"
            ) from None
        if o.kind == "int" and not o.lo <= value <= o.hi:
            raise argparse.ArgumentTypeError(f"{value} is outside [{o.lo}, {o.hi}]")
        if o.kind == "seconds" and not (0 < value and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text} must be a number of seconds > 0")
        return value

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per option; every flag defaults to None ("not given": the recipe's value or
    the option's default applies, see `from_cli`)."""
    compile_group = p.add_argument_group(
        "compile options (QEfficient's names; override the --qpc-config profile)"
    )
    for name, f in _FIELDS.items():
        o = f.metadata["option"]
        target = compile_group if o.group == "compile" else p
        dflt = default(name)
        if o.kind == "bool" and dflt is None:
            target.add_argument(
                flag(name), dest=name, action=argparse.BooleanOptionalAction, help=o.help
            )
        elif o.kind == "bool":
            target.add_argument(
                flag(name), dest=name, action="store_const", const=not dflt, help=o.help
            )
        else:
            shown = "" if dflt is None or "default" in o.help else f" (default {dflt})"
            target.add_argument(flag(name), dest=name, type=_cli_type(name, o), help=o.help + shown)


def from_cli(args: argparse.Namespace, recipe: dict) -> ExportOptions:
    """Options from the command line, else the recipe, else the defaults."""
    values = {}
    for name in _FIELDS:
        given = getattr(args, name, None)
        if given is None and name in RECIPE_OPTIONS:
            given = recipe.get(name)
        if given is not None:
            values[name] = given
    if args.num_speculative_tokens is not None and args.block_size is None:
        values.pop("block_size", None)  # the flag overrides the recipe's block size
    return ExportOptions(**values)
