"""QEfficient's habits: `AutoDFlashModel`, the sequence a QEfficient user types, over our API.

    from dflash_qaic import AutoDFlashModel
    model = AutoDFlashModel.from_pretrained(target, draft, qaic_config={...})
    model.export("artifacts/qwen3-4b")                         # -> the artifacts directory
    qpc = model.compile(prefill_seq_len=128, ctx_len=4096, num_cores=16, mxfp6_matmul=True)
    info = model.generate(prompts, generation_len=64)          # ids, texts, perf figures

A thin face (docs/DESIGN.md, "Coming from QEfficient"): `export` and `compile` call
`dflash_qaic.export` (one transaction that reuses unchanged programs and compiles when asked),
`generate` calls `dflash_qaic.load(...).generate`. Keyword names are QEfficient's where it has
them, mapped here onto the options declared once in dflash_qaic/exporter/options.py; the options
it lacks keep our names. Unlike QEfficient's one ONNX file and one QPC, an export here is a
directory holding both programs (target and draft) and their manifest, so `export` and
`compile` return that directory, the one thing `generate` (and `dflash_qaic.load`) needs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_qaic import api, runtime

log = logging.getLogger(__name__)

__all__ = ["AutoDFlashModel", "DFlashExecInfo", "PerfMetrics", "QEffConfigError"]

#: qaic_config keys of QEfficient's DFlash target, as they are taken here (docs/DESIGN.md)
QAIC_CONFIG_KEYS = {
    "dflash_dlm_repo": "the draft checkpoint (the same as from_pretrained's second argument)",
    "target_layer_ids": "the target hidden states the draft reads, QEfficient's convention "
    "(hidden-state indices, the embeddings at 0: the draft's own layer ids + 1); checked against "
    "the draft's config",
    "dflash_block_size": "the draft block B (option block_size)",
    "block_size": "the draft block B",
    "num_speculative_tokens": "B - 1",
    "include_sampler": "an on-device sampler in the target program (option sampling)",
    "comp_ctx_lengths_prefill": "attention windows (option comp_ctx_lengths; one set serves "
    "prefill and decode here)",
    "comp_ctx_lengths_decode": "attention windows (option comp_ctx_lengths)",
    "pretrained_model_name_or_path": "set by QEfficient's from_pretrained: must be the target",
}
#: qaic_config keys QEfficient has that have no meaning here, and why
REFUSED_KEYS = {
    "dflash_dlm": "one AutoDFlashModel holds both programs: load the target and pass the draft "
    "as the second argument (or as dflash_dlm_repo)",
    "dflash_tlm_repo": "one AutoDFlashModel holds both programs: load the target and pass the "
    "draft as the second argument (or as dflash_dlm_repo)",
    "speculative_model_type": "the target program is always a DFlash verifier here",
    "return_pdfs": "the programs choose tokens on the device; no distributions leave them",
    "max_top_k_ids": "the sampler's top-k candidates are fixed by the export",
    "num_kv_blocks": "blocked KV attention is not implemented; the attention windows "
    "(comp_ctx_lengths) bound a call's reads instead",
}
#: QEfficient's compile keywords that name one of our options differently
RENAMED = {"dflash_block_size": "block_size"}
#: compile keywords of QEfficient's whose value here must be the default shown (or None)
FIXED = {"prefill_only": None, "use_onnx_subfunctions": False}


class QEffConfigError(ValueError):
    """A qaic_config key or compile keyword this face cannot honour: says which and why."""


@dataclass
class PerfMetrics:
    """QEfficient's performance figures of one `generate` call (seconds, tokens/s)."""

    prefill_time: float  # mean time to first token
    decode_perf: float  # tokens/s of one sequence after its first token
    total_perf: float  # tokens/s of one sequence, prefill included (× batch_size: aggregate)
    total_time: float  # wall time of the call


@dataclass
class DFlashExecInfo:
    """What `generate` returns: QEfficient's `CloudAI100ExecInfo` fields, plus τ and our
    per-prompt results (`dflash_qaic.runtime.GenerationResult`: stats, stop reason, …)."""

    batch_size: int
    generated_texts: list[str | None]
    generated_ids: list  # one 1-D int64 numpy array of new tokens per prompt
    perf_metrics: PerfMetrics
    tau: float  # mean tokens committed per DFlash step
    results: list = field(default_factory=list, repr=False)

    def __repr__(self) -> str:
        p = self.perf_metrics
        return (
            f"Average Prefill time a.k.a TTFT is= {round(p.prefill_time, 2)} sec"
            f"\nDecode is= {round(p.decode_perf * self.batch_size, 2)} tokens/sec"
            f"\nTotal is= {round(p.total_perf * self.batch_size, 2)} tokens/sec"
            f"\nTotal (E2E) inference time is= {round(p.total_time, 2)} sec"
            f"\nτ (tokens per DFlash step) is= {round(self.tau, 2)}"
        )


def _names() -> list[str]:
    from dflash_qaic.exporter import options

    return options.names()


def _default_dir(target: Path, draft: Path) -> Path:
    """Where compile writes when neither export nor compile was given a directory (QEfficient
    keeps its exports in a cache directory too)."""
    from dflash_qaic.artifacts.files import cache_dir

    return cache_dir() / "qeff" / f"{target.name}--{draft.name}"


class AutoDFlashModel:
    """A target and its DFlash draft, QEfficient-style (see the module docstring).
    `from_pretrained` makes one; nothing heavy happens until `export`."""

    def __init__(self, target: Path, draft: Path, options: dict, continuous_batching: bool):
        self.target, self.draft = target, draft
        self.options = dict(options)  # program options from qaic_config (our names)
        self.continuous_batching = continuous_batching
        self.export_dir: Path | None = None
        self.qpc_path: Path | None = None  # the compiled artifacts directory (compile)
        self.manifest = None
        self._pipes: dict = {}

    def __repr__(self) -> str:
        return f"AutoDFlashModel(target={str(self.target)!r}, draft={str(self.draft)!r})"

    # ------------------------------------------------------------------ from_pretrained

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        draft: str | os.PathLike | None = None,
        continuous_batching: bool = False,
        qaic_config: dict | None = None,
        **kwargs: Any,
    ) -> AutoDFlashModel:
        """A target checkpoint and its DFlash draft (a second argument, or qaic_config's
        `dflash_dlm_repo` as in QEfficient). Both are read and checked now (configs and tensor
        layouts, no weights). qaic_config: the keys in `QAIC_CONFIG_KEYS`; any other key is a
        QEffConfigError naming it. continuous_batching=True asks for `full_batch_size` at
        compile, as QEfficient does. kwargs: `torch_dtype`/`dtype` float32 only (the programs
        are exported in fp32; the compiler converts to fp16)."""
        from dflash_qaic.extras import require

        _check_arguments(pretrained_model_name_or_path, draft, continuous_batching, qaic_config)
        require("export", "AutoDFlashModel.from_pretrained")
        _check_dtype(kwargs)
        config = dict(qaic_config or {})
        draft = _draft_argument(draft, config)
        from dflash_qaic import checkpoints as ck

        pair = ck.read_pair(pretrained_model_name_or_path, draft)
        named = config.pop("pretrained_model_name_or_path", None)
        if named is not None and str(named) != str(pretrained_model_name_or_path):
            raise QEffConfigError(
                f"qaic_config['pretrained_model_name_or_path'] is {named!r} but the target is "
                f"{str(pretrained_model_name_or_path)!r}: drop the key or make them agree"
            )
        options = qaic_options(config, pair.draft.target_layer_ids)
        return cls(pair.target.path, pair.draft.path, options, continuous_batching)

    # ------------------------------------------------------------------ export / compile

    def export(self, export_dir: str | os.PathLike | None = None, **kwargs: Any) -> Path:
        """Export both programs (ONNX, fp32) to `export_dir` without compiling: returns the
        artifacts directory. kwargs: any export option (QEfficient's compile names or ours);
        shapes not given here take their defaults and may be changed at `compile`."""
        out = Path(export_dir) if export_dir is not None else self._dir(None)
        options = {**self.options, **compile_options(kwargs), "compile": False}
        self._run_export(out, options)
        self.export_dir = out
        return out

    def compile(
        self,
        onnx_path: str | os.PathLike | None = None,
        compile_dir: str | os.PathLike | None = None,
        *,
        prefill_seq_len: int | None = None,
        ctx_len: int | None = None,
        batch_size: int = 1,
        full_batch_size: int | None = None,
        kv_cache_batch_size: int | None = None,
        num_devices: int | None = None,
        num_cores: int | None = None,
        mxfp6_matmul: bool | None = None,
        mxint8_kv_cache: bool | None = None,
        num_speculative_tokens: int | None = None,
        **compiler_options: Any,
    ) -> Path:
        """QEfficient's `compile`: the programs exported for these shapes (reused when they
        already are) and compiled with qaic-compile. Returns the artifacts directory holding
        both programs' QPCs (`self.qpc_path`; QEfficient returns its one QPC's path).

        onnx_path: a directory `export` returned (or a file inside it); compile_dir: where to
        write instead (default: onnx_path's directory, else the last export's, else a
        directory in the cache). None for a shape or compile option: our default (a shape:
        options.py; a compile option: the qpc_config profile's). compiler_options: mos,
        aic_enable_depth_first, dflash_block_size, qpc_config, compile_timeout, and every other
        export option by its name here; an unknown one is a TypeError listing the known ones.

        Without qaic-compile on this machine the export completes for ONNX Runtime and a
        warning names the compiler's search path and the commands to run on an AI100 host
        (the QPC paths in the manifest stay empty; `generate` runs on ONNX Runtime)."""
        if self.continuous_batching and full_batch_size is None:
            raise TypeError("`full_batch_size` is required when `continuous_batching=True`.")
        if kv_cache_batch_size is not None and kv_cache_batch_size != full_batch_size:
            raise QEffConfigError(
                f"kv_cache_batch_size {kv_cache_batch_size} differs from full_batch_size "
                f"{full_batch_size}: the programs keep one cache row per sequence; give "
                "full_batch_size alone"
            )
        given = dict(
            prefill_seq_len=prefill_seq_len,
            ctx_len=ctx_len,
            batch_size=batch_size,
            full_batch_size=full_batch_size,
            num_devices=num_devices,
            num_cores=num_cores,
            mxfp6_matmul=mxfp6_matmul,
            mxint8_kv_cache=mxint8_kv_cache,
            num_speculative_tokens=num_speculative_tokens,
            **compiler_options,
        )
        options = {**self.options, **compile_options(given), "compile": True}
        out = self._dir(compile_dir, onnx_path)
        self.manifest = self._run_export(out, options)
        self.export_dir = self.qpc_path = out
        return out

    def _dir(self, compile_dir, onnx_path=None) -> Path:
        if compile_dir is not None:
            return Path(compile_dir)
        if onnx_path is not None:
            from dflash_qaic.contract import ROLE_NAMES  # a directory per program role

            p = Path(onnx_path)
            while p.suffix == ".onnx" or (p.name in ROLE_NAMES and p.parent != p):
                p = p.parent  # OUT/target/target.onnx -> OUT
            return p
        return self.export_dir or _default_dir(self.target, self.draft)

    def _run_export(self, out: Path, options: dict):

        self._pipes.clear()  # a new export replaces the programs a loaded pipeline runs
        if options.get("num_speculative_tokens") is not None and "block_size" in options:
            n = options.pop("num_speculative_tokens")  # one of the two, as the options take it
            if options["block_size"] != n + 1:
                raise QEffConfigError(
                    f"num_speculative_tokens {n} disagrees with the block size "
                    f"{options['block_size']} (block size = speculative tokens + 1): give one"
                )
        m = api.export(self.target, self.draft, out, **options)
        self.manifest = m
        return m

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        tokenizer=None,
        prompts=None,
        device_id: list[int] | None = None,
        runtime_ai100: bool = True,
        *,
        generation_len: int | None = None,
        backend: str | None = None,
        **sampling: Any,
    ) -> DFlashExecInfo:
        """QEfficient's `generate(tokenizer, prompts, generation_len=)`, also callable as
        `generate(prompts, generation_len=)` (the artifacts carry the target's tokenizer).

        prompts: a text, or a list of texts or token-id lists (a list runs as a continuous
        batch when compiled with full_batch_size). generation_len: new tokens per prompt
        (None: until EOS or ctx_len, as QEfficient). runtime_ai100: True runs the compiled
        QPCs when this host has the AI100 runtime and they exist, else ONNX Runtime (backend
        "auto"); False runs ONNX Runtime. backend: "ort" | "qaic" | "auto" overrides it.
        sampling: temperature, top_k, top_p, seed, do_sample, stop_token_ids (as
        `Pipeline.generate`; greedy by default: the target's own greedy tokens).
        device_id: refused when given (the device ids are the compile profile's)."""
        import time

        import numpy as np

        if prompts is None and _looks_like_prompts(tokenizer):
            tokenizer, prompts = None, tokenizer
        if prompts is None:
            raise TypeError(
                "generate needs prompts: generate(prompts) or generate(tokenizer, prompts)"
            )
        if device_id is not None:
            raise QEffConfigError(
                "device_id: the devices are chosen at compile time here (the qpc_config "
                "profile's device ids, num_devices); drop device_id"
            )
        if backend is None:
            if not isinstance(runtime_ai100, bool):
                raise TypeError(f"runtime_ai100 must be True or False, got {runtime_ai100!r}")
            backend = "auto" if runtime_ai100 else "ort"
        pipe = self._pipeline(backend)
        one = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and not _looks_like_prompts(prompts[0])
        )
        batch = [prompts] if one else list(prompts)
        if tokenizer is not None:
            batch = [tokenizer(p)["input_ids"] if isinstance(p, str) else p for p in batch]
        n = pipe.ctx_len if generation_len is None else generation_len
        t = time.perf_counter()
        results = pipe.generate(batch, max_new_tokens=n, **sampling)
        wall = time.perf_counter() - t
        ids = [np.asarray(r.tokens, dtype=np.int64) for r in results]
        texts = [tokenizer.decode(r.tokens) if tokenizer is not None else r.text for r in results]
        at_once = min(len(batch), pipe.full_batch_size)
        tokens = sum(len(r.tokens) for r in results)
        tpot = [r.stats.get("tpot_s") for r in results if r.stats.get("tpot_s")]
        perf = PerfMetrics(
            prefill_time=float(np.mean([r.stats.get("ttft_s", 0.0) for r in results])),
            decode_perf=1.0 / float(np.mean(tpot)) if tpot else 0.0,
            total_perf=tokens / wall / at_once if wall > 0 else 0.0,
            total_time=wall,
        )
        steps = sum(len(r.acceptance_lengths) for r in results)
        tau = sum(sum(r.acceptance_lengths) for r in results) / steps if steps else 0.0
        return DFlashExecInfo(at_once, texts, ids, perf, tau, list(results))

    def _pipeline(self, backend: str):

        out = self.qpc_path or self.export_dir
        if out is None:
            raise TypeError("Please run export or compile first!")  # QEfficient's words
        if backend not in self._pipes:
            pipe = runtime.load(out, backend=backend)
            log.info("generate: %s on %s", out, pipe.backend)
            self._pipes[backend] = pipe
        return self._pipes[backend]


# ---------------------------------------------------------------------------- mapping


def qaic_options(config: dict, draft_layer_ids) -> dict:
    """Our program options from a qaic_config (its DFlash keys), each checked; a key with no
    meaning here is a QEffConfigError saying why, an unknown one lists the known."""
    config = dict(config)
    config.pop("dflash_dlm_repo", None)  # taken by from_pretrained
    for key in config:
        if key in REFUSED_KEYS:
            raise QEffConfigError(f"qaic_config key {key!r} is not taken here: {REFUSED_KEYS[key]}")
        if key not in QAIC_CONFIG_KEYS:
            known = ", ".join(sorted(QAIC_CONFIG_KEYS))
            raise QEffConfigError(f"unknown qaic_config key {key!r}; known: {known}")
    out: dict = {}
    ids = config.pop("target_layer_ids", None)
    if ids is not None:
        want = [int(i) + 1 for i in draft_layer_ids]
        if not isinstance(ids, (list, tuple)) or list(ids) != want:
            raise QEffConfigError(
                f"qaic_config target_layer_ids {ids!r} are not the layers the draft was trained "
                f"on: its config says {list(draft_layer_ids)} (layer outputs), which QEfficient "
                f"writes as hidden-state indices {want} (the embeddings are index 0); pass "
                f"{want} or drop the key (the draft's config decides)"
            )
    windows = [config.pop(k, None) for k in ("comp_ctx_lengths_prefill", "comp_ctx_lengths_decode")]
    given = [w for w in windows if w is not None]
    if len(given) == 2 and list(given[0]) != list(given[1]):
        raise QEffConfigError(
            f"comp_ctx_lengths_prefill {given[0]!r} and comp_ctx_lengths_decode {given[1]!r} "
            "differ: one set of attention windows serves prefill and decode here; give one"
        )
    if given:
        out["comp_ctx_lengths"] = list(given[-1])
    if "include_sampler" in config:
        out["sampling"] = config.pop("include_sampler")
    for key, value in config.items():
        out[RENAMED.get(key, key)] = value
    from dflash_qaic.exporter import options

    for key, value in out.items():  # each value checked now (ExportError naming it); the
        options.check(key, value)  # checks across options run at export, with the shapes
    return out


def compile_options(kwargs: dict) -> dict:
    """Our option names and values from QEfficient's compile keywords (None: not given)."""
    names = set(_names())
    out = {}
    for key, value in kwargs.items():
        if key in FIXED:
            if value != FIXED[key]:
                raise QEffConfigError(
                    f"{key}={value!r} is not supported: both programs are exported and compiled "
                    f"with all their specializations; leave {key} at {FIXED[key]!r}"
                )
            continue
        name = RENAMED.get(key, key)
        if name not in names:
            known = sorted(names | set(RENAMED) | set(FIXED))
            raise TypeError(f"unknown compile option {key!r}; known: {', '.join(known)}")
        if key == "mos" and value == -1:
            value = None  # QEfficient's "no effort"
        if value is not None:
            out[name] = value
    return out


def _check_arguments(target, draft, continuous_batching, qaic_config) -> None:
    """from_pretrained's argument types, before anything is converted: one sentence each."""
    for name, value in (("pretrained_model_name_or_path", target), ("draft", draft)):
        if not isinstance(value, (str, os.PathLike)) and not (name == "draft" and value is None):
            raise TypeError(
                f"{name} must be a checkpoint directory or hub id (a str or path), got "
                f"{type(value).__name__} {value!r}"
            )
    if not isinstance(continuous_batching, bool):
        raise TypeError(f"continuous_batching must be True or False, got {continuous_batching!r}")
    if qaic_config is not None and not isinstance(qaic_config, dict):
        raise QEffConfigError(
            f"qaic_config must be a dict of QEfficient's DFlash keys such as "
            f"{{'dflash_dlm_repo': draft, 'target_layer_ids': [...]}}, or None; got "
            f"{type(qaic_config).__name__} {qaic_config!r}"
        )
    if qaic_config is not None and not all(isinstance(k, str) for k in qaic_config):
        bad = next(k for k in qaic_config if not isinstance(k, str))
        raise QEffConfigError(f"qaic_config keys must be strings (key names), got {bad!r}")


def _draft_argument(draft, config: dict):
    repo = config.get("dflash_dlm_repo")
    if draft is None and repo is None:
        raise TypeError(
            "AutoDFlashModel.from_pretrained needs the DFlash draft: from_pretrained(target, "
            "draft) or qaic_config={'dflash_dlm_repo': draft}"
        )
    if draft is not None and repo is not None and Path(draft) != Path(repo):
        raise QEffConfigError(
            f"two drafts: the argument {str(draft)!r} and qaic_config['dflash_dlm_repo'] "
            f"{str(repo)!r}: give one"
        )
    return draft if draft is not None else repo


def _check_dtype(kwargs: dict) -> None:
    for key in ("torch_dtype", "dtype"):
        value = kwargs.pop(key, None)
        if value is not None and str(value).removeprefix("torch.") != "float32":
            raise QEffConfigError(
                f"{key}={value!r}: the programs are exported in float32 (the compiler converts "
                "to fp16 with -convert-to-fp16); drop it or pass float32"
            )
    if kwargs:
        raise TypeError(
            f"unknown from_pretrained argument(s) {sorted(kwargs)}: it takes the target, the "
            "draft, continuous_batching, qaic_config and torch_dtype"
        )


def _looks_like_prompts(x) -> bool:
    """A text, or a list of texts / token ids (not a tokenizer)."""
    if isinstance(x, str):
        return True
    if isinstance(x, (list, tuple)):
        return all(isinstance(p, (str, int, list, tuple)) for p in x) and bool(x)
    return False
