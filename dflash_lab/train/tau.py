"""Mean acceptance length τ of a target + draft pair, measured with the reference `dflash`.

    python -m dflash_lab.train.tau --target DIR --draft DIR [--prompts FILE] [--max-new-tokens 128]
        [--temperature T --seed S]

DFlash with `dflash.model.dflash_generate` (the oracle; greedy by default, sampling at
`--temperature` > 0 with torch seeded by seed + prompt index): the draft loaded with
`DFlashDraftModel.from_pretrained(dir, dtype=torch.float32)` (`DFlash2DraftModel` for a DFlash-2
draft, whose sampled path the reference verifies q-aware), the target with
`checkpoints.load_target_model`. Per prompt, τ is the mean over steps of the tokens committed
(accepted + 1, bonus counted); the headline `mean_tau` is the mean of the per-prompt means (as the
reference benchmark reports it); `pooled_tau` pools all steps. Prompts default to the committed
held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def read_prompts(path: str | Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line]


def _short_block_conv() -> None:
    """dflash 0.1.0's DFlash-2 conv fails on a block shorter than its kernel (the last block of a
    generation: `F.pad` of an empty slice makes `offset` rows, not the block's). Causal outputs
    do not depend on later rows, so such a block is zero-padded at its end to the kernel's length
    and the output cut back: exactly what the conv means, and unchanged for full blocks."""
    import dflash.model as ref

    conv = ref._grouped_dynamic_convolve
    if getattr(conv, "pads_short_blocks", False):
        return

    def padded(hidden, dynamic, base, group_size):
        L, K = hidden.shape[1], base.shape[0]
        if L >= K:
            return conv(hidden, dynamic, base, group_size)
        grow = lambda t: torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, K - L))  # noqa: E731
        return conv(grow(hidden), grow(dynamic), base, group_size)[:, :L]

    padded.pads_short_blocks = True
    ref._grouped_dynamic_convolve = padded


def _cpu_clock() -> None:
    """dflash 0.1.0 times its stats with torch.cuda.synchronize; on CPU use the wall clock."""
    import dflash.model as ref

    if not torch.cuda.is_available():
        ref._cuda_time = time.perf_counter


@torch.no_grad()
def measure_tau(
    target_dir: str | Path,
    draft_dir: str | Path,
    prompts: list[str],
    max_new_tokens: int = 128,
    block_size: int | None = None,
    check_greedy: bool = False,
    target=None,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict:
    """τ per prompt and overall. `check_greedy` also runs Hugging Face greedy `generate` and
    records whether DFlash produced exactly its tokens."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate
    from transformers import AutoTokenizer

    from dflash_qaic import checkpoints as ck

    _cpu_clock()
    _short_block_conv()
    pair = ck.read_pair(target_dir, draft_dir)
    target = target if target is not None else ck.load_target_model(target_dir)
    cls = DFlash2DraftModel if pair.draft.dflash2 else DFlashDraftModel
    draft = cls.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    per_prompt, steps, greedy_equal, outputs = [], [], [], []
    for i, text in enumerate(prompts):
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        torch.manual_seed(seed + i)
        res = dflash_generate(
            draft,
            target,
            ids,
            max_new_tokens,
            None,
            temperature=temperature,
            block_size=block_size,
            return_stats=True,
        )
        per_prompt.append(statistics.mean(res.acceptance_lengths))
        steps.extend(res.acceptance_lengths)
        outputs.append(res.output_ids[0, ids.shape[1] :].tolist())
        if check_greedy:
            hf = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            greedy_equal.append(torch.equal(hf, res.output_ids))
    out = {
        "mean_tau": round(statistics.mean(per_prompt), 3),
        "pooled_tau": round(statistics.mean(steps), 3),
        "per_prompt_tau": [round(x, 3) for x in per_prompt],
        # histogram[i]: steps that committed i + 1 tokens (the last step may be cut short)
        "histogram": [steps.count(n) for n in range(1, (block_size or draft.block_size) + 1)],
        "block_size": block_size or draft.block_size,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "outputs": outputs,
    }
    if check_greedy:
        out["greedy_equal"] = greedy_equal
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash_lab.train.tau", description=__doc__)
    p.add_argument("--target", default=None, help="default: the committed pair's target")
    p.add_argument("--draft", default=None, help="default: the committed pair's draft")
    p.add_argument("--prompts", default=None, help="JSONL with a 'prompt' field per line")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--check-greedy", action="store_true", help="compare with HF greedy generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--seed", type=int, default=0, help="sampling: torch seed of prompt i is seed + i"
    )
    p.add_argument("--show", action="store_true", help="print the first output as text")
    a = p.parse_args(argv)
    from dflash_qaic import assets

    torch.set_num_threads(a.threads)
    tdir, ddir = assets.default_pair()
    tdir, ddir = Path(a.target or tdir), Path(a.draft or ddir)
    prompts = read_prompts(a.prompts) if a.prompts else assets.heldout_prompts()
    if a.check_greedy and a.temperature > 0:
        raise SystemExit("--check-greedy compares with greedy generate: use --temperature 0")
    res = measure_tau(
        tdir,
        ddir,
        prompts,
        a.max_new_tokens,
        a.block_size,
        check_greedy=a.check_greedy,
        temperature=a.temperature,
        seed=a.seed,
    )
    if a.show:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tdir), local_files_only=True)
        print(prompts[0] + "⟨" + tok.decode(res["outputs"][0]) + "⟩")
    res.pop("outputs")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
