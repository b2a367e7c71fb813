"""The PyTorch peers on the same pair and CPU, at T = 0: the reference `dflash_generate` (with
the artifacts' block size, and with block_size=1: its own target-only loop; its
`DFlash2DraftModel` for a DFlash-2 draft) and Hugging Face greedy `generate` of the target. Same prompts, token budget and thread count as ours."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

NAMES = ("reference_dflash", "reference_target", "hf_generate")


class _Stamps(list):
    """A transformers streamer that stamps every put: the prompt, then each generated token."""

    def put(self, _value):
        self.append(time.perf_counter())

    def end(self):
        pass


def skip_reason(f: dict) -> str | None:
    for who, path in f["sources"].items():
        if not path or not Path(path, "config.json").is_file():
            return f"the source {who} checkpoint ({path}) is gone"
    try:
        import dflash.model  # noqa: F401
    except ImportError:
        return "the reference package `dflash` is not installed"
    return None


def reference_draft_class(path):
    """The reference's model class of a draft checkpoint: `DFlash2DraftModel` for a DFlash-2
    draft (its convs and selector), else `DFlashDraftModel`."""
    from dflash import model as ref

    from dflash_qaic.checkpoints import read_draft_config

    return ref.DFlash2DraftModel if read_draft_config(path).dflash2 else ref.DFlashDraftModel


def _systems(f: dict, max_new: int):
    """{name: run(ids tensor) -> (tokens, ttft_s, tpot_s, acceptance lengths or None)}."""
    import torch
    from dflash import model as ref
    from transformers.utils import logging as hf_logging

    from dflash_qaic.checkpoints import load_target_model

    ref._cuda_time = time.perf_counter  # the reference syncs CUDA; on a CPU: the wall clock
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    target = load_target_model(f["sources"]["target"])
    cls = reference_draft_class(f["sources"]["draft"])
    draft = cls.from_pretrained(f["sources"]["draft"], dtype=torch.float32)
    pad = f["eos"][0] if f["eos"] else 0

    def reference(block):
        def run(ids):
            o = ref.dflash_generate(
                draft, target, ids, max_new, None, block_size=block, return_stats=True
            )
            toks = o.output_ids[0, ids.shape[1] :].tolist()
            lengths = [int(a) for a in o.acceptance_lengths]
            return toks, float(o.time_to_first_token), float(o.time_per_output_token), lengths

        return run

    def hf(ids):
        s, t = _Stamps(), time.perf_counter()
        with torch.inference_mode():
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=pad,
                streamer=s,
            )
        end, first = time.perf_counter(), s[1]  # s[0]: the prompt's put
        # TPOT as the reference defines it: the time after the first token / all tokens
        return out[0, ids.shape[1] :].tolist(), first - t, (end - first) / (len(s) - 1), None

    return dict(zip(NAMES, (reference(f["block_size"]), reference(1), hf)))


def run_peers(f: dict, prompts, max_new: int, rounds: int, threads: int, ours, log) -> dict:
    """One warm-up of each system on the first prompt, then `rounds` rounds over all prompts,
    the order alternating. `ours`: our T = 0 tokens per prompt (the peers must agree)."""
    reason = skip_reason(f)
    if reason:
        return {"skipped": reason}
    import torch

    torch.set_num_threads(threads)
    systems = _systems(f, max_new)
    tensors = [torch.tensor([p.ids]) for p in prompts]
    for run in systems.values():
        run(tensors[0])
    rec = {n: [[] for _ in prompts] for n in NAMES}
    for r in range(rounds):
        for i, ids in enumerate(tensors):
            for n in NAMES[:: 1 if (r + i) % 2 == 0 else -1]:
                rec[n][i].append(systems[n](ids))
        log(f"  peers round {r + 1}/{rounds}")
    out = {"torch_threads": torch.get_num_threads(), "systems": {}, "prompts": len(prompts)}
    out["reference_draft"] = reference_draft_class(f["sources"]["draft"]).__name__
    for n in NAMES:
        tpot = [np.mean([runs[r][2] for runs in rec[n]]) for r in range(rounds)]
        out["systems"][n] = {
            "ttft_s": float(np.median([x[1] for runs in rec[n] for x in runs])),
            "tpot_s": float(np.median(tpot)),
            "tokens_per_s": float(np.median([1 / t for t in tpot])),
            "same_tokens": sum(all(x[0] == ours[i] for x in runs) for i, runs in enumerate(rec[n])),
        }
    ref_d, ref_t = out["systems"]["reference_dflash"], out["systems"]["reference_target"]
    out["reference_speedup"] = ref_t["tpot_s"] / ref_d["tpot_s"]
    out["reference_tau"] = float(np.mean([a for runs in rec[NAMES[0]] for a in runs[0][3]]))
    return out
