"""`dflash-bench ARTIFACTS --concurrency 1,2,4,8`: continuous batching, DFlash against the target
alone on the same program at each concurrency, and a report.

    dflash-export --out artifacts/default-cb8 --full-batch-size 8
    dflash-bench artifacts/default-cb8 --concurrency 1,2,4,8     # writes bench/latest-batch/
    dflash-bench artifacts/default-cb8 --concurrency 1,2 --max-new-tokens 16 --repeats 1

At each concurrency c the same requests (each prompt `--requests-per-prompt` times) run with at
most c in flight, a closed loop as c clients sending back to back, in both modes, the order
alternating; every request's tokens are compared with its prompt's solo run; at the largest c
both admission policies (`prefill_chunks_per_step` None and 1). Exits 1 when a request's tokens
differ from its solo run, 2 on bad input.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from dflash_qaic import contract
from dflash_qaic.bench import stats
from dflash_qaic.bench.run import BenchError

MODES = ("dflash", "baseline")  # generate / generate_baseline
POLICIES = (None, 1)  # prefill_chunks_per_step: every waiting prompt / one chunk between steps
OPTIONS = [  # flag, type, default, help
    ("--concurrency", str, None, "comma-separated concurrencies, e.g. 1,2,4,8 (required)"),
    ("--max-new-tokens", int, 128, "tokens per request"),
    ("--repeats", int, 3, "timed rounds"),
    ("--requests-per-prompt", int, 2, "each prompt's requests per run (closed loop, c in flight)"),
    ("--num-prompts", int, None, "distinct prompts (None: the largest concurrency); more than "
     "that many run the requests of more prompts through the same c slots"),
    ("--warmup", int, 1, "discarded rounds first"),
    ("--out", str, "bench/latest-batch", "output directory"),
    ("--prompts", str, None, "prompts file as for the decode benchmark; None: the default "
     "pair's held-out prompts, else random ids"),
    ("--threads", int, None, "ONNX Runtime threads; None: the runtime's default"),
    ("--temperature", float, 0.0, "0 = greedy"),
    ("--top-k", int, 0, "top-k at T > 0 (0: off)"),
    ("--top-p", float, 1.0, "top-p at T > 0 (1: off)"),
    ("--seed", int, 0, "base seed of the sampled runs (one seed per prompt and mode)"),
    ("--peers", str, None, "vllm: upstream vLLM's own DFlash on the artifacts' source "
     "checkpoints, in .venv-vllm/, after ours in the same run (T = 0; bench/upstream.py)"),
    ("--vllm-python", str, None, "the Python of vLLM's environment; None: "
     "$DFLASH_QAIC_VLLM_PYTHON, else .venv-vllm/bin/python"),
]  # fmt: skip


def check_fits(full_batch_size: int | None, concurrency: list[int], artifacts) -> None:
    """The program must hold the largest concurrency at once (one cache row per request)."""
    rows, c = full_batch_size or 1, max(concurrency)
    if c > rows:
        how = f"full_batch_size {full_batch_size}" if full_batch_size else "no continuous batching"
        raise BenchError(
            f"--concurrency {c} needs {c} sequences at once, but {artifacts} holds {rows} "
            f"({how}): export with `dflash-export --full-batch-size {c}` (or lower --concurrency)"
        )


def _main(args, command: str) -> int:
    from dflash_qaic.bench import batch_report, run
    from dflash_qaic.bench.frame import _log, bench, check_common, parse_list

    args.concurrency = sorted(parse_list("--concurrency", args.concurrency, int))
    check_common(args, ("max_new_tokens", "repeats"))
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise BenchError("--temperature must be a finite number ≥ 0 (0 is greedy)")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise BenchError("--num-prompts must be ≥ 1")
    from dflash_qaic.bench import upstream

    args.peers = upstream.parse_peers(args.peers)
    if args.peers and args.temperature != 0:
        raise BenchError("--peers vllm runs at --temperature 0 (where tokens must be identical)")
    if args.peers:
        upstream.find_python(args.vllm_python)  # no environment: fail before measuring

    def body(pipe, f):
        check_fits(f["full_batch_size"], args.concurrency, args.artifacts)
        if args.temperature > 0 and not pipe.can_sample:
            raise BenchError("these artifacts have no sampler (--no-sampling): use --temperature 0")
        cmax = max(args.concurrency)
        tok, n = pipe.tokenizer, args.max_new_tokens
        want = max(cmax, args.num_prompts or cmax)
        prompts, source = run.select_prompts(f, tok, n, args.prompts, want)
        if len(prompts) < cmax:
            raise BenchError(
                f"--concurrency {cmax} needs {cmax} distinct prompts, {source} has "
                f"{len(prompts)}: give more with --prompts or lower --concurrency"
            )
        _log(f"{len(prompts)} prompts from {source}")
        if args.peers:
            upstream.sources(f)  # the checkpoints vLLM runs: fail before measuring
        measured = measure(pipe, prompts, args, _log)
        notes = {"prompts_source": source, "prompts": [p.name for p in prompts]}
        parts = summarise(measured, args.concurrency, args.temperature)
        if args.peers:
            ours = measured["solo"]["dflash"]
            parts["peers"] = upstream.run(f, prompts, args, ours, Path(args.out), _log)
        return parts, notes

    return bench(args, command, batch_report, body)


# ---------------------------------------------------------------------------- measuring


class _Timed:
    """A program whose calls are counted and timed by kind while a batch runs: where the batch's
    wall time goes (the engine's own call times count a shared call once per request in it).
    The kind comes from the call's shapes: target ids of 1 column are a decode call, of a
    `prefill_rows` count (a prefill length, all above B) a prefill call, else a verify call (of
    one of the verify lengths); draft context of a `prefill_rows` count (the DraftPrefill rows)
    is a prompt's draft call, else a step's."""

    def __init__(self, program, is_target: bool, prefill_rows: set[int], budget: dict):
        self._program, self._target, self._budget = program, is_target, budget
        self._prefill_rows = prefill_rows

    def __getattr__(self, name):
        return getattr(self._program, name)

    def run(self, feeds):
        t = time.perf_counter()
        out = self._program.run(feeds)
        dt = time.perf_counter() - t
        if self._target:
            n = feeds[contract.INPUT_IDS].shape[1]
            kind = "decode" if n == 1 else "prefill" if n in self._prefill_rows else "verify"
        else:
            n = feeds[contract.TARGET_HIDDEN].shape[1]
            kind = "draft_prefill" if n in self._prefill_rows else "draft"
        got = self._budget.setdefault(kind, [0, 0.0])
        got[0], got[1] = got[0] + 1, got[1] + dt
        return out


class _Runner:
    """Runs batches of the first c prompts in one mode under one admission policy, with each
    prompt's settings (its own seed per mode when sampling), and checks every request against
    the prompt's solo run."""

    def __init__(self, pipe, prompts, args):
        from dflash_qaic.bench.run import sample_seed

        self.pipe, self.prompts = pipe, prompts
        self.kw = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=[])
        T = args.temperature
        self.kw["temperature"] = T
        if T > 0:
            self.kw.update(top_k=args.top_k, top_p=args.top_p)
        self.seeds = {  # the same seed in every round: a request's tokens are fixed
            m: [sample_seed(args.seed, T, i, 0, m) if T > 0 else None for i in range(len(prompts))]
            for m in MODES
        }
        self.per_prompt = args.requests_per_prompt
        self.solo: dict[str, list[list[int]]] = {}
        self.checks: list[dict] = []  # {"label", "mode", "tokens": [...]} of every batch run

    def _gen(self, mode):
        return self.pipe.generate if mode == "dflash" else self.pipe.generate_baseline

    def run_solo(self) -> None:
        """Each prompt alone, once per mode: the reference tokens."""
        for m in MODES:
            self.solo[m] = [
                self._gen(m)(p.ids, **self.kw, seed=self.seeds[m][i]).tokens
                for i, p in enumerate(self.prompts)
            ]

    def batch(self, c: int, mode: str, policy, label: str) -> dict:
        """The same requests at every concurrency (each prompt `requests_per_prompt` times),
        at most c in flight: a closed loop where a finished request's slot is taken by the next
        one at once, as c clients sending back to back would (a single batch of c would measure
        its slowest request instead)."""
        pipe, budget = self.pipe, {}
        saved = pipe.configure(prefill_chunks_per_step=policy, max_running=c)
        programs = pipe.target, pipe.draft
        plan = pipe.artifacts.plan
        pipe.target = _Timed(pipe.target, True, set(plan.prefill_lengths), budget)
        pipe.draft = _Timed(pipe.draft, False, set(plan.draft_prefill_rows), budget)
        index = [j % len(self.prompts) for j in range(self.per_prompt * len(self.prompts))]
        try:
            t = time.perf_counter()
            res = self._gen(mode)(
                [self.prompts[i].ids for i in index],
                **self.kw,
                seed=[self.seeds[mode][i] for i in index],
            )
            wall = time.perf_counter() - t
        finally:
            pipe.configure(saved)
            pipe.target, pipe.draft = programs
        self.checks.append(
            {"label": label, "mode": mode, "tokens": [r.tokens for r in res], "index": index}
        )
        budget = {k: {"calls": n, "s": sec} for k, (n, sec) in budget.items()}
        return {"wall_s": wall, "results": res, "budget": budget}


def measure(pipe, prompts, args, log) -> dict:
    """Solo runs, then per round every concurrency in both modes (the order alternating), then
    the other admission policy at the largest concurrency. Returns the timed batches by
    (c, mode, policy), the solo tokens and the checked batches."""
    concs, cmax = args.concurrency, max(args.concurrency)
    default = pipe.config.prefill_chunks_per_step
    others = [p for p in POLICIES if p != default]
    runner = _Runner(pipe, prompts, args)
    log(f"solo runs: {len(prompts)} prompts × {len(MODES)} modes (the reference tokens)")
    runner.run_solo()
    runs: dict[tuple, list[dict]] = {}
    plan = [(c, default) for c in concs] + [(cmax, p) for p in others]
    log(f"{args.warmup} warm-up + {args.repeats} rounds × concurrency {concs} × {len(MODES)} modes")
    for r in range(args.warmup + args.repeats):
        t0, stage = time.perf_counter(), f"round {r - args.warmup + 1}/{args.repeats}"
        stage = stage if r >= args.warmup else "warm-up"
        for k, (c, policy) in enumerate(plan):
            got = {}
            for mode in MODES[:: 1 if (r + k) % 2 == 0 else -1]:
                got[mode] = runner.batch(c, mode, policy, f"c={c} {mode} {stage} policy={policy}")
                if r >= args.warmup:
                    runs.setdefault((c, mode, policy), []).append(got[mode])
            tps = {
                m: sum(len(x.tokens) for x in b["results"]) / b["wall_s"] for m, b in got.items()
            }
            note = "" if policy == default else f" (prefill_chunks_per_step={policy})"
            log(
                f"  {stage} c={c}{note}: DFlash {tps['dflash']:.0f} tokens/s, target alone "
                f"{tps['baseline']:.0f} tokens/s ({time.perf_counter() - t0:.0f} s)"
            )
    return {"runs": runs, "solo": runner.solo, "checks": runner.checks, "default": default}


# ---------------------------------------------------------------------------- summarising


def equality(solo: dict, checks: list[dict], greedy: bool) -> dict:
    """Every request of every batch against its prompt's solo run of the same mode (same seed);
    at T = 0 also DFlash's solo runs against the target's (lossless)."""
    problems, total = [], 0

    def compare(a, b, what):
        nonlocal total
        total += 1
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            problems.append(f"{what}: tokens differ from index {at}")

    for chk in checks:
        for i, toks in zip(chk.get("index", range(len(chk["tokens"]))), chk["tokens"]):
            compare(toks, solo[chk["mode"]][i], f"{chk['label']}, prompt {i}")
    if greedy:
        for i, (d, b) in enumerate(zip(solo["dflash"], solo["baseline"])):
            compare(d, b, f"solo prompt {i}, DFlash against the target alone")
    n = len(problems)
    return {"equal": total - n, "total": total, "passed": n == 0, "problems": problems}


def points(runs: dict, concs: list[int], policy) -> list[dict]:
    """Per concurrency: both modes' batch_point and the round-by-round ratios (against c = 1 of
    the same mode when measured, and DFlash against the target alone)."""
    by_c = {c: {m: stats.batch_point(runs[c, m, policy]) for m in MODES} for c in concs}
    rounds = {c: {m: x["rounds_tokens_per_s"] for m, x in by_c[c].items()} for c in concs}
    out = []
    for c in concs:
        vs_c1 = {
            m: stats.round_ratios(rounds[c][m], rounds[1][m]) if 1 in concs else None for m in MODES
        }
        ratios = {
            "dflash_vs_target": stats.round_ratios(rounds[c]["dflash"], rounds[c]["baseline"]),
            "vs_c1": vs_c1,
        }
        ratios["bound"], ratios["steps"] = step_ratios(by_c[c])
        out.append({"concurrency": c, "modes": by_c[c], "ratios": ratios})
    return out


def step_ratios(modes: dict) -> tuple[float | None, float | None]:
    """DFlash ÷ target alone if only the steps counted, (bound, steps); None without the calls.
    bound: τ · T_decode / (T_verify + T_draft) with the mean calls of these batches (stats.bound),
    as if every step were shared by all c requests. steps: the target alone's decode seconds per
    batch over DFlash's verify + draft seconds per batch, with the batches' real occupancy
    (prefill, the draft's prompt calls and host work left out)."""
    d, b = modes["dflash"]["budget"], modes["baseline"]["budget"]
    if "verify" not in d or "decode" not in b:
        return None, None
    spent = lambda x, k: x[k]["calls_per_batch"] * x[k]["call_s"] if k in x else 0.0  # noqa: E731
    draft = d["draft"]["call_s"] if "draft" in d else 0.0
    tau = modes["dflash"]["tau"]
    bound = stats.bound(tau, b["decode"]["call_s"], d["verify"]["call_s"], draft)
    return bound, spent(b, "decode") / (spent(d, "verify") + spent(d, "draft"))


def summarise(measured: dict, concs: list[int], temperature: float) -> dict:
    """The results' measured part: points, the admission policies and equality."""
    runs, default, cmax = measured["runs"], measured["default"], max(concs)
    pts = points(runs, concs, default)
    policies = [
        {
            "prefill_chunks_per_step": p,
            "default": p == default,
            "modes": {m: stats.batch_point(runs[cmax, m, p]) for m in MODES},
        }
        for p in POLICIES
        if (cmax, MODES[0], p) in runs
    ]
    return {
        "points": pts,
        "policy": {"concurrency": cmax, "default": default, "policies": policies},
        "equality": equality(measured["solo"], measured["checks"], temperature == 0),
    }
