"""τ under the extended sampling settings (docs/sampling.md, What it costs, what it does to τ).

    python -m dflash_lab.sampling_tau ARTIFACTS [--prompts 12] [--max-new-tokens 128]
        [--unadjusted-draft]

ARTIFACTS: exported with `--extended-sampling`. Per setting (`SETTINGS`: none, repetition
1.1, repetition 1.05 + presence 0.3, presence 0.5 + frequency 0.5, a logit bias, a bad word)
and temperature (0; 1 with seed = the
prompt's index), the mean over the first N held-out prompts of each generation's τ (the tokens
committed per step), every step verifying the whole block (`fixed_steps`). --unadjusted-draft feeds the draft neutral settings (`UnadjustedDraft`):
it then proposes as a draft exported without the option, the target's choices unchanged.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from dflash_qaic import contract as c

SETTINGS = {
    "none": {},
    "repetition 1.1": {"repetition_penalty": 1.1},
    "repetition 1.05 + presence 0.3": {"repetition_penalty": 1.05, "presence_penalty": 0.3},
    "presence 0.5 + frequency 0.5": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "logit_bias 'e' −100": {"logit_bias": {101: -100.0}},  # the byte-level tokenizer's 'e'
    "bad_words ['=']": {"bad_words": [[61]]},
}


class UnadjustedDraft:
    """A draft program taking the extended sampling inputs, fed the settings that change
    nothing (repetition 1, no penalty, bias, stop ids nor bad words): its proposals are the
    unadjusted logits' argmax, a draft without the option's."""

    def __init__(self, program):
        self.program = program

    def __getattr__(self, name):
        return getattr(self.program, name)

    def run(self, feeds: dict) -> dict:
        neutral = {c.REPETITION_PENALTY: 1.0, c.PRESENCE_PENALTY: 0.0, c.FREQUENCY_PENALTY: 0.0}
        neutral |= {c.LOGIT_BIAS: 0.0, c.MIN_TOKENS_STOP_IDS: -1, c.BAD_WORDS: -1}
        feeds = dict(feeds)
        for name in neutral.keys() & feeds.keys():
            feeds[name] = np.full_like(feeds[name], neutral[name])
        return self.program.run(feeds)


def fixed_steps(pipe) -> None:
    """Every step drafts and verifies the whole block: τ is then a count fixed by the
    proposals alone (the default policy and verify lengths follow measured timings)."""
    pipe.configure(verify_lengths=[pipe.B], spec_policy="always")


def measure(pipe, prompts: list[str], new_tokens: int, settings: dict, temperature: float):
    """(mean τ over the prompts, the generated token ids per prompt)."""
    taus, outs = [], []
    for i, prompt in enumerate(prompts):
        seed = i if temperature > 0 else None
        res = pipe.generate(
            prompt, max_new_tokens=new_tokens, temperature=temperature, seed=seed, **settings
        )
        taus.append(res.stats["tau"])
        outs.append(list(res.tokens))
    return float(np.mean(taus)), outs


def main(argv=None) -> None:
    import dflash_qaic
    from dflash_qaic import assets

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--unadjusted-draft", action="store_true")
    a = p.parse_args(argv)
    pipe = dflash_qaic.load(a.artifacts)
    fixed_steps(pipe)
    if a.unadjusted_draft:
        pipe.draft = UnadjustedDraft(pipe.draft)
    prompts = assets.heldout_prompts()[: a.prompts]
    table = {}
    for name, settings in SETTINGS.items():
        for t in (0.0, 1.0):
            table[f"{name} T={t:g}"] = measure(pipe, prompts, a.max_new_tokens, settings, t)[0]
            print(f"{name:32s} T={t:g}  τ {table[f'{name} T={t:g}']:.2f}", flush=True)
    print(json.dumps(table))


if __name__ == "__main__":
    main()
