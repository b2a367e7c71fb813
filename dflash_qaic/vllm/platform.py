"""The vLLM platform that runs our exported programs (docs/DESIGN.md, vLLM platform plugin).

vLLM calls `check_and_update_config` while it builds its config (in the process that parses the
arguments: the API server, or the `LLM` caller). Here the platform finds the artifacts, checks
them against what the user typed, and fixes vLLM's settings so its scheduler drives our step:

- one cache row of the artifacts is one vLLM block: block_size = max_model_len, blocks = rows
  + 1 (block 0 is vLLM's null block), max_num_seqs at most the rows;
- prefix caching is our engine's, not vLLM's block manager's: vLLM's --enable-prefix-caching
  (on by default) and --kv-offloading-size are kept for our worker (`prefix_caching`) and
  vLLM's own are turned off, since a block it matched would count as computed state that only
  our worker's rows hold;
- no chunked prefill and a token budget that holds every row's prompt: a request's prompt is
  scheduled whole, and our engine prefills it in its own chunks;
- vLLM's speculative decoding on, `num_speculative_tokens` = block size − 1: the scheduler
  schedules each request's drafts (taken from our draft call), our verify accepts, and vLLM
  counts what was accepted (`vllm:spec_decode_*`). The proposer is our worker itself, so the
  config names the `custom_class` method (no draft model for vLLM to load);
- synchronous scheduling, one engine-core process running our worker in-process;
- max_model_len = min(its own, ctx_len − 1): vLLM ends a request (`length`) at that many
  tokens, before our engine runs out of cache positions (it holds ctx_len); a prompt longer than
  ctx_len − 1 − B (room for one verify block: `contract.max_prompt`, the rule `Pipeline` and
  dflash-serve apply) is refused in `validate_request`.

`validate_request` refuses (HTTP 400) what the programs cannot do, in one sentence.
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import PlatformEnum

from dflash_qaic import contract

log = logging.getLogger("dflash_qaic.vllm")

#: the key of our block in vLLM's --additional-config, and the keys it takes (dflash-serve's
#: options of the same names: --backend, --threads, --verify-lengths, --spec-policy)
KEY = "dflash_qaic"
KEYS = ("artifacts", "backend", "device_ids", "threads", "verify_lengths", "spec_policy")
BACKENDS = ("ort", "qaic", "auto", "qaic-standin")
#: our worker: vLLM's worker class, and the proposer its speculative config names
WORKER = "dflash_qaic.vllm.worker.DFlashWorker"
#: vLLM's scheduler, which also ends the requests whose program call failed
SCHEDULER = "dflash_qaic.vllm.scheduler.DFlashScheduler"
#: the KV connector of two `vllm serve` split into prefill and decode (vllm/connector.py)
CONNECTOR = "DFlashQaicConnector"
#: the key of --additional-config that keeps vLLM's --enable-prefix-caching for our worker
PREFIX_CACHING = "dflash_qaic_prefix_caching"
#: vLLM's "greedy" threshold (temperatures below it sample greedily)
GREEDY_EPS = 1e-5


class PluginConfigError(ValueError):
    """What the user typed does not fit the artifacts: says what and how to fix it."""


@dataclass(frozen=True)
class Settings:
    """The plugin's settings, resolved from vLLM's config (stored back in additional_config,
    so the engine-core process reads the same)."""

    artifacts: str
    backend: str = "ort"
    device_ids: tuple[int, ...] | None = None
    threads: int | None = None
    verify_lengths: tuple[int, ...] | None = None
    spec_policy: str | None = None  # the step policy (None: the runtime's default)

    @classmethod
    def of(cls, vllm_config) -> Settings:
        block = dict((vllm_config.additional_config or {}).get(KEY) or {})
        return cls(
            artifacts=block["artifacts"],
            backend=block.get("backend", "ort"),
            device_ids=tuple(block["device_ids"]) if block.get("device_ids") else None,
            threads=block.get("threads"),
            verify_lengths=tuple(block["verify_lengths"]) if block.get("verify_lengths") else None,
            spec_policy=block.get("spec_policy"),
        )


@dataclass(frozen=True)
class Limits:
    """What a request may ask of these artifacts (read from the manifest once)."""

    can_sample: bool
    max_top_k: int
    vocab: int
    max_prompt: int  # tokens: room for one verify block after the prompt
    structured: bool = False  # the target program takes a token bitmask (--structured-output)
    extended: bool = False  # the target takes penalties, bad words, … (--extended-sampling)
    logprobs: int = 0  # the top K the target returns per row (--logprobs K; 0: none)


def _block(vllm_config) -> dict:
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        return {}
    block = extra.get(KEY) or {}
    if not isinstance(block, dict):
        raise PluginConfigError(
            f"--additional-config {KEY!r} must be an object, e.g. "
            f'\'{{"{KEY}": {{"artifacts": "artifacts/default"}}}}\', got {block!r}'
        )
    unknown = set(block) - set(KEYS)
    if unknown:
        raise PluginConfigError(
            f"--additional-config {KEY}: unknown key(s) {sorted(unknown)}; the keys are "
            f"{', '.join(KEYS)}"
        )
    return block


def _is_artifacts(path) -> bool:
    return isinstance(path, str) and (Path(path) / "manifest.json").is_file()


def _check_pair(model_config, spec, m, artifacts: str) -> None:
    """The upstream spelling: TARGET and DRAFT must be the checkpoints the artifacts were
    exported from (the manifest's sha256 of each one's config.json and safetensors)."""
    from dflash_qaic.checkpoints import file_digest

    B = m.block_size
    if spec is None:
        raise PluginConfigError(
            f"--additional-config {KEY}.artifacts {artifacts} runs the target {model_config.model} "
            "with its DFlash draft: also give --speculative-config "
            f'\'{{"method": "dflash", "model": DRAFT, "num_speculative_tokens": {B - 1}}}\' '
            f"(or serve the artifacts directly: vllm serve {artifacts})"
        )
    if spec.method != "dflash":
        raise PluginConfigError(
            f"--speculative-config method {spec.method!r}: the artifacts {artifacts} hold a "
            'DFlash pair; use "method": "dflash"'
        )
    if spec.num_speculative_tokens != B - 1:
        raise PluginConfigError(
            f"--speculative-config num_speculative_tokens {spec.num_speculative_tokens}: the "
            f"artifacts {artifacts} were exported with block size {B}, so it must be {B - 1}"
        )
    sources = m.sources or {}
    draft_dir = spec.draft_model_config.model if spec.draft_model_config else spec.model
    for role, given in (("target", model_config.model), ("draft", draft_dir)):
        want = (sources.get(role) or {}).get("sha256")
        if not want:
            raise PluginConfigError(
                f"{artifacts}/manifest.json records no {role} checkpoint digest: re-export the "
                "artifacts with this version of dflash-export"
            )
        if not Path(given).is_dir():
            raise PluginConfigError(
                f"the {role} {given!r} is not a local directory: give the checkpoint directory "
                f"the artifacts were exported from ({(sources.get(role) or {}).get('path')})"
            )
        if file_digest(given) != want:
            raise PluginConfigError(
                f"the artifacts {artifacts} were not exported from the {role} {given} (its "
                f"config.json and weights differ from {(sources.get(role) or {}).get('path')}): "
                f"export this pair with dflash-export, or give the {role} they came from"
            )


def _argv_value(flag: str) -> str | None:
    """The value of `flag` on vLLM's command line (None: not given there)."""
    names = {flag, flag.replace("-", "_")}
    for i, a in enumerate(sys.argv):
        name, eq, value = a.partition("=")
        if name in names:
            return value if eq else (sys.argv[i + 1] if i + 1 < len(sys.argv) else "")
    return None


class DFlashQaicPlatform(CpuPlatform):
    """A CPU host as far as torch and vLLM's own code are concerned (`is_cpu()`: no accelerator
    for torch to empty or pin; the programs run on ONNX Runtime or the AI100 runtime, outside
    torch), our worker as the model runner."""

    _enum = PlatformEnum.CPU
    device_name: str = "cpu"
    device_type: str = "cpu"
    limits: Limits | None = None  # set by check_and_update_config, read by validate_request

    @classmethod
    def update_block_size_for_backend(cls, vllm_config) -> None:
        """block_size is the cache row (set in check_and_update_config): no attention backend
        of vLLM's runs here to prefer another."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        if vllm_config.model_config is None:
            return
        block = _block(vllm_config)
        artifacts, m = _artifacts_of(vllm_config, block)
        B, ctx_len, rows = m.block_size, m.ctx_len, m.full_batch_size or 1
        backend = _checked_backend(block, m)
        M = _fit_to_artifacts(vllm_config, artifacts, rows, ctx_len)
        _install_worker(vllm_config, block, artifacts, backend, B)
        _keep_prefix_caching(vllm_config)
        _connector_module(vllm_config)
        cls.limits = Limits(
            can_sample=m.target.io.sampling,
            max_top_k=m.target.sampling_candidates or m.vocab_size,
            vocab=m.vocab_size,
            max_prompt=contract.max_prompt(ctx_len, B),
            structured=m.target.io.token_bitmask,
            extended=m.target.io.extended_sampling,
            logprobs=m.target.io.logprobs,
        )
        _logprobs_mode(vllm_config, m)
        _own_min_p_and_logit_bias()
        log.info(
            "dflash-qaic: %s on %s, %d cache row(s), block %d, max_model_len %d",
            artifacts,
            backend,
            rows,
            B,
            M,
        )

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """One sentence for what the programs cannot do (vLLM answers it with a 400)."""
        _prefill_leg(params)
        from vllm.exceptions import VLLMValidationError

        def refuse(param: str, what: str) -> None:
            raise VLLMValidationError(
                f"{what} is not supported by dflash-qaic's programs (they choose each token on "
                "the device)",
                parameter=param,
            )

        if isinstance(processed_inputs, dict) and processed_inputs.get("type") == "embeds":
            refuse("prompt_embeds", "prompt_embeds")
        ids = (
            processed_inputs.get("prompt_token_ids") if isinstance(processed_inputs, dict) else None
        )
        if ids is not None and cls.limits is not None and len(ids) > cls.limits.max_prompt:
            raise VLLMValidationError(
                f"the prompt has {len(ids)} tokens, but these programs take at most "
                f"{cls.limits.max_prompt} (ctx_len − 1 − the block size: room for one verify "
                "block); shorten the prompt or re-export with a larger --ctx-len",
                parameter="prompt",
            )
        from vllm.sampling_params import SamplingParams

        if not isinstance(params, SamplingParams):
            refuse("pooling", "pooling (embeddings, scores)")
        p = params
        logprobs_check(p, cls.limits)
        for name in ("structured_outputs", "allowed_token_ids"):
            if getattr(p, name, None) and cls.limits is not None and not cls.limits.structured:
                raise VLLMValidationError(
                    f"{name}: these artifacts' target program takes no token bitmask; "
                    "re-export them with `dflash-export --structured-output`",
                    parameter=name,
                )
        for name in ("logprob_token_ids", "prompt_logprob_token_ids", "thinking_token_budget"):
            if getattr(p, name, None) is not None:
                refuse(name, name)
        if getattr(p, "logits_processors", None):
            refuse("logits_processors", "logits_processors")
        sampling_check(p, cls.limits)


def logprobs_check(p, limits: Limits | None) -> None:
    """vLLM's logprobs and prompt_logprobs (−1: the whole vocabulary) against the top K the
    artifacts' target program returns per row (--logprobs K): a VLLMValidationError naming the
    re-export otherwise."""
    from vllm.exceptions import VLLMValidationError

    asked = {n: getattr(p, n) for n in ("logprobs", "prompt_logprobs")}
    asked = {n: k for n, k in asked.items() if k is not None}
    if not asked or limits is None:
        return
    name, k = max(asked.items(), key=lambda item: item[1] if item[1] >= 0 else 1 << 30)
    want = contract.MAX_LOGPROBS if k < 0 else min(max(k, 1), contract.MAX_LOGPROBS)
    if not limits.logprobs:
        raise VLLMValidationError(
            f"{name} is not supported by these artifacts' target program (it returns no "
            f"logprobs): re-export them with `dflash-export --logprobs {want}`",
            parameter=name,
        )
    if k < 0 or k > limits.logprobs:
        raise VLLMValidationError(
            f"{name} {k} is above the {limits.logprobs} alternatives these artifacts' target "
            f"program returns: ask for 0 … {limits.logprobs}, or re-export them with "
            f"`dflash-export --logprobs {want}` (up to "
            f"{contract.MAX_LOGPROBS})",
            parameter=name,
        )


def logprob_settings(p, limits_k: int) -> dict:
    """Our request's logprob settings of vLLM's SamplingParams: the artifacts' whole top K
    (`limits_k`) whenever any are asked (vLLM keeps each request's own k of them, and the K
    make a token's rank exact when it is among them); None: none asked."""
    return {
        name: (limits_k if getattr(p, name) is not None else None)
        for name in ("logprobs", "prompt_logprobs")
    }


def _logprobs_mode(vllm_config, m) -> None:
    """vLLM's --logprobs-mode is the artifacts' (`dflash-export --logprobs-mode`): taken from
    them unless typed, refused when typed otherwise."""
    have = m.target.io.logprobs_mode
    model_config = vllm_config.model_config
    if not m.target.io.logprobs or model_config.logprobs_mode == have:
        return
    if _argv_value("--logprobs-mode") is not None:
        raise PluginConfigError(
            f"--logprobs-mode {model_config.logprobs_mode}: the artifacts' target program "
            f"returns {have}; drop --logprobs-mode, or re-export with `dflash-export "
            f"--logprobs-mode {model_config.logprobs_mode}`"
        )
    model_config.logprobs_mode = have


def _own_min_p_and_logit_bias() -> None:
    """vLLM refuses min_p and logit_bias under speculative decoding (its rejection sampler does
    not apply them). Our programs apply both on the device in every verify row, as the target
    alone would (docs/sampling.md), and `validate_request` refuses them on artifacts without
    --extended-sampling; so for our worker's speculative config vLLM's check is skipped."""
    from vllm.sampling_params import SamplingParams

    upstream = SamplingParams._validate_spec_decode
    if getattr(upstream, "dflash_qaic", False):
        return

    def check(self, speculative_config) -> None:
        ours = speculative_config is not None and speculative_config.model == WORKER
        if not (ours and speculative_config.method == "custom_class"):
            upstream(self, speculative_config)

    check.dflash_qaic = True
    SamplingParams._validate_spec_decode = check


def _extended(p, limits: Limits | None) -> dict:
    """The extended sampling parameters vLLM passes on (penalties, min_tokens, bad words as
    vLLM tokenized them; vLLM itself refuses min_p and logit_bias with speculative decoding),
    refused when the artifacts were exported without --extended-sampling."""
    from vllm.exceptions import VLLMValidationError

    from dflash_qaic.runtime.requests import extended_settings

    ext = extended_settings(lambda name, off: getattr(p, name, off))
    if ext and limits is not None and not limits.extended:
        name = next(iter(ext))
        raise VLLMValidationError(
            f"{name} is not supported by these artifacts' target program (no extended "
            "sampling inputs): re-export them with `dflash-export --extended-sampling`",
            parameter=name,
        )
    if "bad_words" in ext:
        ext["bad_words"] = getattr(p, "bad_words_token_ids", None) or []
    return ext


def sampling_check(p, limits: Limits | None):
    """Our sampler's settings of vLLM's SamplingParams, checked as `Pipeline.sampling` checks
    them (a VLLMValidationError naming the parameter otherwise). Returns a dict for
    `Pipeline.request`."""
    from vllm.exceptions import VLLMValidationError

    from dflash_qaic.runtime.pipeline import GenerationError, Sampling

    temperature = 0.0 if p.temperature < GREEDY_EPS else float(p.temperature)
    top_k = 0 if p.top_k is None or p.top_k <= 0 else int(p.top_k)  # vLLM: 0 and -1 are off
    kw = dict(temperature=temperature, top_k=top_k, top_p=float(p.top_p), seed=p.seed)
    kw |= _extended(p, limits)
    try:
        sp = Sampling.checked(**kw)
    except GenerationError as e:
        raise VLLMValidationError(str(e)) from e
    if limits is not None and not sp.greedy:
        if not limits.can_sample:
            raise VLLMValidationError(
                "these artifacts' target program has no sampler (exported without sampling): "
                "use temperature 0, or re-export with dflash-export",
                parameter="temperature",
            )
        if sp.top_k > limits.max_top_k and limits.max_top_k < limits.vocab:
            raise VLLMValidationError(
                f"top_k {sp.top_k} is above the {limits.max_top_k} candidates these programs "
                f"sample from: use top_k ≤ {limits.max_top_k}, or 0 (off)",
                parameter="top_k",
            )
    return kw


def accepts_device_ids() -> bool:
    """Whether this version's `dflash_qaic.load` takes device_ids."""
    import dflash_qaic

    return "device_ids" in inspect.signature(dflash_qaic.load).parameters


def _artifacts_of(vllm_config, block: dict):
    """The artifacts directory vLLM serves (the model, or --additional-config's) and its
    manifest; the tokenizer the export copied beside it when vLLM would read the directory's."""
    model_config = vllm_config.model_config
    spec = vllm_config.speculative_config
    # vLLM re-runs this in the engine-core process on the config made here: ours already
    ours = spec is not None and spec.method == "custom_class" and spec.model == WORKER
    artifacts = block.get("artifacts")
    upstream = artifacts is not None and not ours
    if artifacts is None:
        artifacts = model_config.model
    artifacts = str(artifacts)
    if not _is_artifacts(artifacts):
        raise PluginConfigError(
            f"{artifacts} is not a dflash-export artifacts directory (no manifest.json), and "
            "DFLASH_QAIC_VLLM=1 makes vLLM run exported programs only: serve an artifacts "
            "directory (vllm serve ARTIFACTS), "
            f'name it in --additional-config \'{{"{KEY}": {{"artifacts": DIR}}}}\', or '
            "unset DFLASH_QAIC_VLLM to run vLLM's own platform"
        )
    artifacts = str(Path(artifacts).resolve())
    from dflash_qaic.artifacts.manifest import read_manifest

    m = read_manifest(artifacts, check_files="none")  # the worker's load checks the files
    if upstream:
        _check_pair(model_config, spec, m, artifacts)
    elif spec is not None and not ours:
        raise PluginConfigError(
            f"--speculative-config: {artifacts} carries its own DFlash draft; drop "
            "--speculative-config (or give the target and draft with --additional-config "
            f'\'{{"{KEY}": {{"artifacts": DIR}}}}\')'
        )
    else:  # the tokenizer the export copied beside the manifest
        tok = m.tokenizer
        if tok and Path(model_config.tokenizer).resolve() == Path(artifacts):
            model_config.tokenizer = str(Path(artifacts) / tok)
    return artifacts, m


def _checked_backend(block: dict, m) -> str:
    """--additional-config's backend, device_ids, threads and verify_lengths, checked; returns
    the backend."""
    backend = block.get("backend", "ort")
    if backend not in BACKENDS:
        raise PluginConfigError(
            f"--additional-config {KEY}.backend {backend!r}: use one of {', '.join(BACKENDS)}"
        )
    devices = block.get("device_ids")
    if devices is not None and (
        not isinstance(devices, list)
        or not devices
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
    ):
        raise PluginConfigError(
            f"--additional-config {KEY}.device_ids must be a list of device ids ≥ 0, "
            f"e.g. [0, 1]; got {devices!r}"
        )

    threads = block.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
        raise PluginConfigError(
            f"--additional-config {KEY}.threads must be an integer, got {threads!r}"
        )
    if block.get("verify_lengths") is not None:
        from dflash_qaic.runtime.engine import EngineConfig

        try:
            EngineConfig(verify_lengths=block["verify_lengths"]).step_lengths(
                m.plan, m.draft.io.confidence
            )
        except (TypeError, ValueError) as e:
            raise PluginConfigError(f"--additional-config {KEY}.{e}") from e
    if block.get("spec_policy") is not None:
        from dflash_qaic.runtime.engine import EngineConfig

        try:
            EngineConfig(spec_policy=block["spec_policy"])
        except ValueError as e:
            raise PluginConfigError(f"--additional-config {KEY}.{e}") from e
    return backend


def _fit_to_artifacts(vllm_config, artifacts: str, rows: int, ctx_len: int) -> int:
    """vLLM's scheduler, cache and model length fitted to the artifacts: one request per cache
    row, one cache block per request; returns max_model_len."""
    model_config = vllm_config.model_config
    # one request per cache row
    sched = vllm_config.scheduler_config
    if sched.max_num_seqs > rows:
        if _argv_value("--max-num-seqs") is not None:
            raise PluginConfigError(
                f"--max-num-seqs {sched.max_num_seqs}: the artifacts {artifacts} hold {rows} "
                f"cache row{'s' * (rows > 1)}, so at most {rows} sequences run at once; use "
                f"--max-num-seqs {rows} or export with --full-batch-size "
                f"{sched.max_num_seqs}"
            )
        log.info(
            "max_num_seqs %d -> %d: the artifacts hold %d cache rows",
            sched.max_num_seqs,
            rows,
            rows,
        )
        sched.max_num_seqs = rows
    limit = contract.max_positions(ctx_len)  # vLLM ends a request here, before our engine must
    if model_config.max_model_len > limit:
        if _argv_value("--max-model-len") is not None:
            log.warning(
                "--max-model-len %d lowered to %d: the artifacts' programs hold ctx_len %d",
                model_config.max_model_len,
                limit,
                ctx_len,
            )
        model_config.max_model_len = limit
    M = model_config.max_model_len
    if hasattr(sched, "max_model_len"):
        sched.max_model_len = M
    model_config.enforce_eager = True

    cache = vllm_config.cache_config
    cache.block_size = M
    cache.user_specified_block_size = True
    cache.num_gpu_blocks_override = sched.max_num_seqs + 1  # + vLLM's null block

    sched.enable_chunked_prefill = False
    sched.async_scheduling = False
    sched.max_num_batched_tokens = sched.max_num_seqs * M
    if getattr(sched, "max_num_scheduled_tokens", None) is not None:
        sched.max_num_scheduled_tokens = sched.max_num_batched_tokens
    sched.long_prefill_token_threshold = 0
    return M


def _keep_prefix_caching(vllm_config) -> None:
    """vLLM's --enable-prefix-caching (on by default, as vLLM resolved it) and
    --kv-offloading-size (GiB of host memory) are our engine's settings (runtime/prefix.py
    matches and resumes in its own cache rows, its host tier holds evicted rows); vLLM runs with
    neither: its block manager never marks a matched prefix as computed (only our worker's rows
    hold that state; the worker reports its hits to our scheduler, vllm/scheduler.py), and it
    makes no offloading connector of its own. Kept in additional_config, since the engine-core
    process re-runs this on the config made here."""
    extra = vllm_config.additional_config
    cache = vllm_config.cache_config
    size = cache.kv_offloading_size
    if size is not None and (isinstance(size, bool) or not size >= 0):
        raise PluginConfigError(
            f"--kv-offloading-size {size}: give the host tier's GiB, a number ≥ 0 (or leave it "
            "out: no host tier)"
        )
    if PREFIX_CACHING not in extra:
        extra[PREFIX_CACHING] = {
            "enable_prefix_caching": bool(cache.enable_prefix_caching),
            "kv_offloading_size": cache.kv_offloading_size,
        }
    cache.enable_prefix_caching = False
    cache.kv_offloading_size = None


def prefix_caching(vllm_config) -> dict:
    """Our engine's prefix-cache settings (`enable_prefix_caching`, `kv_offloading_size`): the
    user's vLLM options, kept by the platform."""
    kept = (vllm_config.additional_config or {}).get(PREFIX_CACHING) or {}
    return {"enable_prefix_caching": True, "kv_offloading_size": None, **kept}


def _connector_module(vllm_config) -> None:
    """--kv-transfer-config's DFlashQaicConnector needs no registration: vLLM imports it from
    our module (vllm/connector.py: prefill/decode between two `vllm serve`)."""
    c = vllm_config.kv_transfer_config
    if c is not None and c.kv_connector == CONNECTOR and not c.kv_connector_module_path:
        c.kv_connector_module_path = "dflash_qaic.vllm.connector"


def _prefill_leg(p) -> None:
    """A P/D prefill leg (vllm/connector.py: {"do_remote_decode": true}, one token, which the
    router drops): vllm-router's min_tokens 1 asks nothing of it, so it is cleared here, before
    vLLM copies the parameters into the request."""
    kv = (getattr(p, "extra_args", None) or {}).get("kv_transfer_params") or {}
    if kv.get("do_remote_decode") and getattr(p, "max_tokens", None) == 1:
        if (getattr(p, "min_tokens", 0) or 0) <= 1:
            p.min_tokens = 0


def _install_worker(vllm_config, block: dict, artifacts: str, backend: str, B: int) -> None:
    """Our worker as vLLM's speculative "custom_class", eager, in the engine-core process."""
    from vllm.config import CompilationMode, SpeculativeConfig

    model_config = vllm_config.model_config
    vllm_config.speculative_config = SpeculativeConfig(
        method="custom_class",
        model=WORKER,
        num_speculative_tokens=B - 1,
        target_model_config=model_config,
        target_parallel_config=vllm_config.parallel_config,
    )
    comp = vllm_config.compilation_config
    comp.mode = CompilationMode.NONE
    comp.cudagraph_capture_sizes = []

    par = vllm_config.parallel_config
    par.distributed_executor_backend = "uni"  # our worker in the engine-core process
    par.worker_cls = WORKER

    vllm_config.scheduler_config.scheduler_cls = SCHEDULER  # a failed request ends alone
    vllm_config.additional_config = dict(vllm_config.additional_config or {})
    vllm_config.additional_config[KEY] = {
        **block,
        "artifacts": artifacts,
        "backend": backend,
    }
