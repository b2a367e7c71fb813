"""`dflash-bench --multi-turn`: an agent-like conversation with and without prefix caching.

    dflash-bench --multi-turn ARTIFACTS [--turns 8] [--system-tokens 600] [--user-tokens 40]
                 [--max-new-tokens 32] [--repeats 3] [--kv-offloading-size GIB]
                 [--agent] [--out FILE.json]

The trace: a system prompt with its tool list (--system-tokens), then --turns turns, each
re-sending the whole history (the system prompt, every earlier user message and answer) plus
a new user message (--user-tokens); each answer is --max-new-tokens tokens (greedy, no stop).
Token ids are drawn from a seeded generator, so every run sends the same trace. The trace runs
with the cache off, then on (fresh: its first turn misses), --repeats times after one warm-up
turn; per turn it reports the median time to first token of both, their ratio, the prompt
tokens found cached and the prefill tokens saved, and checks that the answers are the same
tokens with and without the cache (exit 1 otherwise).

--agent: each turn sends the system prompt and its own user message only, no history (an
agent's independent requests sharing one system prompt and tool list; on a hybrid or sliding
target they hit at the block boundary saved where the prompts branch, from the third turn on).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np


def trace(vocab: int, args) -> tuple[list[int], list[list[int]]]:
    """The system prompt and each turn's user message (seeded ids, below the vocabulary)."""
    rng = np.random.default_rng(args.seed)
    hi = min(vocab, 1000)
    system = rng.integers(3, hi, args.system_tokens).tolist()
    return system, [rng.integers(3, hi, args.user_tokens).tolist() for _ in range(args.turns)]


def conversation(pipe, system, users, max_new: int, agent: bool = False) -> list[dict]:
    """One run of the trace: per turn its prompt length, TTFT, cached tokens and answer (agent:
    each turn the system prompt and its user message, no history)."""
    history, out = list(system), []
    for user in users:
        history = system + user if agent else history + user
        res = pipe.generate(history, max_new, stop_token_ids=[])
        out.append(
            dict(
                prompt=len(history),
                ttft_s=res.stats["ttft_s"],
                cached=res.stats["cached_tokens"],
                tokens=res.tokens,
            )
        )
        history += res.tokens
    return out


def measure(pipe, args) -> dict:
    """The trace without and with the cache, --repeats times each (a fresh cache each time)."""
    system, users = trace(pipe.vocab, args)
    pipe.generate(system[:8], 2, stop_token_ids=[])  # warm-up: sessions and buffers
    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for cache in (False, True):
            pipe.configure(enable_prefix_caching=False)  # drops the cache
            pipe.configure(enable_prefix_caching=cache)
            runs[cache].append(conversation(pipe, system, users, args.max_new_tokens, args.agent))
    turns = []
    for t in range(args.turns):
        cold = statistics.median(r[t]["ttft_s"] for r in runs[False])
        warm = statistics.median(r[t]["ttft_s"] for r in runs[True])
        first = runs[True][0][t]
        turns.append(
            dict(
                turn=t + 1,
                prompt_tokens=first["prompt"],
                cached_tokens=first["cached"],
                ttft_s_no_cache=cold,
                ttft_s_cache=warm,
                ratio=warm / cold if cold > 0 else None,
                same_tokens=all(
                    r[t]["tokens"] == runs[False][0][t]["tokens"] for r in runs[True] + runs[False]
                ),
            )
        )
    later = [t["ratio"] for t in turns[1:] if t["ratio"] is not None]
    return dict(
        turns=turns,
        prefill_tokens_saved=sum(t["cached_tokens"] for t in turns),
        prompt_tokens=sum(t["prompt_tokens"] for t in turns),
        worst_ratio_turn_2_on=max(later) if later else None,
        tokens_equal=all(t["same_tokens"] for t in turns),
    )


def table(report: dict) -> str:
    lines = ["turn  prompt  cached  TTFT off (ms)  TTFT on (ms)  on/off  same tokens"]
    for t in report["turns"]:
        lines.append(
            f"{t['turn']:>4}  {t['prompt_tokens']:>6}  {t['cached_tokens']:>6}  "
            f"{1e3 * t['ttft_s_no_cache']:>13.1f}  {1e3 * t['ttft_s_cache']:>12.1f}  "
            f"{t['ratio']:>6.2f}  {t['same_tokens']}"
        )
    lines.append(
        f"prefill tokens saved {report['prefill_tokens_saved']} of {report['prompt_tokens']}; "
        f"worst TTFT ratio from turn 2: {report['worst_ratio_turn_2_on']:.2f}"
    )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    from dflash_qaic.commands import doc_parser
    from dflash_qaic.runtime import options

    p = doc_parser("dflash-bench --multi-turn", __doc__)
    options.add_arguments(p, "backend", "threads", "check_files")
    options.SPEC_POLICY.add(p)
    options.KV_OFFLOADING_SIZE.add(p)  # the cached runs' host tier (the cache is off, then on)
    for flag, default, text in (
        ("--turns", 8, "turns of the conversation"),
        ("--system-tokens", 600, "tokens of the system prompt and tools"),
        ("--user-tokens", 40, "tokens of each user message"),
        ("--max-new-tokens", 32, "tokens of each answer"),
        ("--repeats", 3, "runs of the trace each way (medians)"),
        ("--seed", 0, "seed of the trace's ids"),
    ):
        p.add_argument(flag, type=int, default=default, help=f"{text} (default %(default)s)")
    p.add_argument(
        "--agent",
        action="store_true",
        help="each turn the system prompt and its own user message, no history",
    )
    p.add_argument("--out", default=None, help="write the report as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    import dflash_qaic
    from dflash_qaic.runtime import options

    args = parser().parse_args(argv)
    for name in ("turns", "repeats", "max_new_tokens", "system_tokens", "user_tokens"):
        if getattr(args, name) < 1:
            print(
                f"dflash-bench --multi-turn: --{name.replace('_', '-')} must be ≥ 1",
                file=sys.stderr,
            )
            return 2
    pipe = dflash_qaic.load(
        args.artifacts, **options.from_args(args, "backend", "threads", "check_files")
    )
    size = options.KV_OFFLOADING_SIZE.value(args)
    pipe.configure(spec_policy=options.SPEC_POLICY.value(args), kv_offloading_size=size)
    turns = 1 if args.agent else args.turns  # the longest prompt holds this many turns
    need = args.system_tokens + turns * (args.user_tokens + args.max_new_tokens)
    if need >= pipe.ctx_len:
        print(
            f"dflash-bench --multi-turn: the trace needs {need} positions, the artifacts hold "
            f"{pipe.ctx_len - 1}: fewer --turns or shorter messages",
            file=sys.stderr,
        )
        return 2
    report = measure(pipe, args)
    report["kv_offloading_size"] = size
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if report["tokens_equal"] else 1
