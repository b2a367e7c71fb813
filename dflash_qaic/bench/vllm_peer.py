"""The upstream vLLM peer's driver: vLLM's own DFlash on a Hugging Face target and draft.

Runs under the Python of `.venv-vllm/` (vLLM pins its own transformers; see docs/DESIGN.md,
"Upstream vLLM as a peer"), started by `dflash-bench --peers vllm` (bench/upstream.py) as

    .venv-vllm/bin/python -I dflash_qaic/bench/vllm_peer.py IN.json OUT.json

It imports only the standard library at the top (vLLM spawns its engine process, which imports
this file again as `__mp_main__`) and nothing of this package, so it runs whether or not
dflash-qaic is installed beside vLLM. IN.json: {"target", "draft", "num_speculative_tokens",
"prompts": [[ids]], "max_new_tokens", "concurrency": [c], "requests_per_prompt", "rounds",
"warmup", "max_num_seqs"}. OUT.json: {"vllm": version, "load_s", "solo": {"tokens": [[ids] per
prompt], "steps": [[tokens committed per engine step] per prompt]}, "runs": {"c": [one dict per
timed round: wall_s, tokens, tpot_s (per request), drafts, draft_tokens, accepted,
accepted_per_pos, same_as_solo, requests]}}.

At each concurrency c the same requests (each prompt `requests_per_prompt` times) run through one
`LLM`'s engine with at most c in flight, a closed loop as our batch benchmark runs them; greedy,
`ignore_eos`, exactly `max_new_tokens` each. τ comes from vLLM's own spec-decode counters
(`llm.get_metrics()`), taken before and after each run.
"""

from __future__ import annotations

import json
import sys
import time

SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counters(llm) -> dict:
    """vLLM's spec-decode counters now (cumulative since the engine started)."""
    out = {v: 0 for v in SPEC_METRICS.values()}
    out["accepted_per_pos"] = []
    for m in llm.get_metrics():
        if m.name in SPEC_METRICS:
            out[SPEC_METRICS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            old = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(vals, old + [0] * len(vals))]
    return out


def delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in SPEC_METRICS.values()}
    b = before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"])
    out["accepted_per_pos"] = [a - x for a, x in zip(after["accepted_per_pos"], b)]
    return out


def closed_loop(llm, prompts, index, c: int, params) -> tuple[float, dict, dict, list]:
    """Requests prompts[i] for i in index, at most c in flight (a finished request's slot is
    taken by the next at once). Returns (wall seconds, {request: tokens}, {request: tokens
    committed per engine step}, TPOT of each request: seconds after its first token ÷ the
    tokens after it, as ours)."""
    engine = llm.llm_engine
    todo, tokens, steps, seen, first, tpot = list(enumerate(index)), {}, {}, {}, {}, []
    in_flight = 0
    t = time.perf_counter()
    while todo or in_flight:
        while todo and in_flight < c:
            r, i = todo.pop(0)
            engine.add_request(str(r), {"prompt_token_ids": list(prompts[i])}, params)
            in_flight += 1
        for out in engine.step():
            r = int(out.request_id)
            ids = list(out.outputs[0].token_ids)
            grown = len(ids) - seen.get(r, 0)
            if grown > 0:
                steps.setdefault(r, []).append(grown)
                seen[r] = len(ids)
                first.setdefault(r, (time.perf_counter(), len(ids)))
            if out.finished:
                tokens[r] = ids
                in_flight -= 1
                t1, n1 = first[r]
                if len(ids) > n1:
                    tpot.append((time.perf_counter() - t1) / (len(ids) - n1))
    return time.perf_counter() - t, tokens, steps, tpot


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        cfg = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(
        model=cfg["target"],
        speculative_config={
            "method": "dflash",
            "model": cfg["draft"],
            "num_speculative_tokens": cfg["num_speculative_tokens"],
        },
        dtype="float32",
        enforce_eager=True,
        max_num_seqs=cfg["max_num_seqs"],
        disable_log_stats=False,
        enable_prefix_caching=False,
        seed=0,
    )
    load_s = time.perf_counter() - t
    params = SamplingParams(
        temperature=0.0, max_tokens=cfg["max_new_tokens"], ignore_eos=True, detokenize=False
    )
    prompts = cfg["prompts"]
    # each prompt alone: the tokens to compare with ours, and its tokens per engine step
    _, solo, solo_steps, _ = closed_loop(llm, prompts, list(range(len(prompts))), 1, params)
    index = [j % len(prompts) for j in range(cfg["requests_per_prompt"] * len(prompts))]
    runs: dict[str, list] = {}
    for r in range(cfg["warmup"] + cfg["rounds"]):
        for c in cfg["concurrency"]:
            before = counters(llm)
            wall, got, _, tpot = closed_loop(llm, prompts, index, c, params)
            rec = {"wall_s": wall, "tokens": sum(len(v) for v in got.values()), "tpot_s": tpot}
            rec.update(delta(counters(llm), before))
            rec["same_as_solo"] = sum(got[k] == solo[i] for k, i in enumerate(index))
            rec["requests"] = len(index)
            if r >= cfg["warmup"]:
                runs.setdefault(str(c), []).append(rec)
            print(
                f"vllm peer: round {r + 1 - cfg['warmup']} c={c}: "
                f"{rec['tokens'] / wall:.0f} tokens/s",
                file=sys.stderr,
                flush=True,
            )
    out = {
        "vllm": vllm.__version__,
        "load_s": load_s,
        "solo": {
            "tokens": [solo[i] for i in range(len(prompts))],
            "steps": [solo_steps[i] for i in range(len(prompts))],
        },
        "runs": runs,
    }
    with open(argv[1], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
