"""Training a small target and a DFlash draft for it, on CPU, from a corpus every machine has.

    python -m dflash_lab.train.target --corpus stdlib --out runs/target --steps N --seed S
    python -m dflash_lab.train.draft  --target runs/target --corpus stdlib --out runs/draft
    python -m dflash_lab.train.tau    --target runs/target --draft runs/draft

`corpus` (the Python standard library split, the byte tokenizer, held-out prompts), `target`
(a few-million-parameter Qwen3 trained from scratch), `draft` (the DFlash draft trainer, for any
supported target directory) and `tau` (mean acceptance length with the reference `dflash`).
"""
