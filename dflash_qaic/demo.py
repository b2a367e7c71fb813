"""`make demo`: export the built-in default pair, generate through ONNX Runtime, and show τ and
the speedup over the target alone (both runs in this process, on the same target program).

    python -m dflash_qaic.demo [--out artifacts/default] [--prompt TEXT] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="artifacts/default", help="artifacts directory")
    p.add_argument("--prompt", default=None, help="prompt text (default: a held-out prompt)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each, medians reported")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)

    import dflash_qaic
    from dflash_qaic.export.cli import main as export_main
    from dflash_qaic.runtime.cli import format_stats

    t0 = time.perf_counter()
    print(f"== 1/3 export the default pair to {a.out} (ONNX; AI100 compile if a compiler exists)")
    rc = export_main(["--out", a.out])
    if rc:
        return rc
    print("\n== 2/3 generate with DFlash on ONNX Runtime")
    pipe = dflash_qaic.load(a.out, backend="ort", threads=a.threads)
    prompt = a.prompt
    if prompt is None:
        from dflash_qaic.assets import heldout_prompts

        prompt = heldout_prompts()[0]
    kw = dict(max_new_tokens=a.max_new_tokens, stop_token_ids=[])
    pipe.generate(prompt, **kw)  # warm-up (first-call allocations)
    pipe.generate_baseline(prompt, **kw)
    runs, bases = [], []
    for _ in range(max(1, a.repeats)):  # alternate, so drift hits both alike
        bases.append(pipe.generate_baseline(prompt, **kw))
        runs.append(pipe.generate(prompt, **kw))
    res = runs[-1]
    print(f"--- prompt ---\n{prompt}\n--- DFlash output ---\n{res.text}\n---")
    print(f"[dflash] {format_stats(res.stats)}")
    print(f"[target] {format_stats(bases[-1].stats)}")
    lossless = all(r.tokens == b.tokens for r, b in zip(runs, bases))
    speedup = statistics.median(b.stats["tpot_s"] for b in bases) / statistics.median(
        r.stats["tpot_s"] for r in runs
    )
    print("\n== 3/3 summary")
    print(f"output identical to the target alone: {'yes' if lossless else 'NO'}")
    print(f"mean acceptance length τ = {res.stats['tau']:.2f} (block {pipe.B})")
    print(
        f"speedup over the target alone = {speedup:.2f}× "
        f"(median time per output token over {len(runs)} runs each, same program, same process)"
    )
    print(f"demo took {time.perf_counter() - t0:.0f} s")
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
