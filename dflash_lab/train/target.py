"""Train a small Qwen3 target from scratch on a byte-level corpus (by default the Python stdlib).

    python -m dflash_lab.train.target --corpus stdlib --out runs/target --steps 1200 --seed 0

Writes a Hugging Face directory: `config.json`, `generation_config.json`, `model.safetensors`
and the byte-level tokenizer (`tokenizer.json`, `tokenizer_config.json`; see `corpus`), so
`AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(OUT, local_files_only=True)` load it.
Training state lives in `OUT/train_state/` (checkpoint, log, summary); `--resume` continues from
the last checkpoint. Training windows are random `seq_len + 1`-token slices of the corpus stream
(files joined by EOS), drawn by a generator seeded with (seed, step): a run is a function of its
arguments and the thread count.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from dflash_lab.train import corpus as C
from dflash_lab.train.common import (
    DTYPES,
    THREADS_HELP,
    Log,
    adamw,
    atomic_save,
    atomic_write_text,
    lr_at,
    resume,
    step_generator,
    torch_settings,
)

# Settings that must match for --resume (the rest, e.g. --save-every, may change).
RESUME_KEYS = (
    "corpus",
    "steps",
    "seed",
    "batch_size",
    "seq_len",
    "lr",
    "warmup",
    "weight_decay",
    "hidden_size",
    "layers",
    "heads",
    "kv_heads",
    "intermediate_size",
    "threads",
)


def make_config(a: argparse.Namespace):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=C.BYTE_VOCAB_SIZE,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.hidden_size // a.heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=C.EOS_ID,
        pad_token_id=C.EOS_ID,
    )


def token_stream(docs: list[tuple[str, str]]) -> torch.Tensor:
    """All documents as byte ids, each followed by EOS: int64 [N]."""
    parts = []
    for _, text in docs:
        parts.append(torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8))
        parts.append(torch.tensor([C.EOS_ID]))
    return torch.cat([p.long() for p in parts])


def windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return stream[starts[:, None] + torch.arange(length)]


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


@torch.no_grad()
def eval_loss(model, stream: torch.Tensor, seq_len: int, n: int = 32, seed: int = 1234) -> float:
    """Mean next-byte loss (nats) over `n` fixed windows of `stream`."""
    was = model.training
    model.eval()
    batch = windows(stream, n, seq_len + 1, torch.Generator().manual_seed(seed))
    loss = sum(lm_loss(model, batch[i : i + 8]).item() for i in range(0, n, 8)) / ((n + 7) // 8)
    model.train(was)
    return loss


def init_weights(model, std: float = 0.02) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)


def export(model, out: Path, dtype: torch.dtype) -> None:
    """config, weights (in `dtype`) and the tokenizer into `out`, written atomically (a temp
    directory beside it, then renamed file by file)."""
    import copy

    tmp = out.parent / f".{out.name}.export"
    shutil.rmtree(tmp, ignore_errors=True)
    m = copy.deepcopy(model).to(dtype).eval()
    m.config.use_cache = True
    m.generation_config.eos_token_id = C.EOS_ID
    m.generation_config.pad_token_id = C.EOS_ID
    m.save_pretrained(tmp)
    C.build_byte_tokenizer().save_pretrained(tmp)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(tmp.iterdir()):
        f.replace(out / f.name)
    tmp.rmdir()


def train(a: argparse.Namespace, stop_after: int | None = None) -> dict:
    """Run (or resume) training as `a` says; returns the summary."""
    with torch_settings(a.seed, a.threads):
        return _train(a, stop_after)


def _train(a: argparse.Namespace, stop_after: int | None) -> dict:
    out = Path(a.out)
    state_dir = out / "train_state"
    ckpt_path = state_dir / "checkpoint.pt"
    settings = {k: getattr(a, k) for k in RESUME_KEYS}

    docs = C.read_corpus(a.corpus)
    stream = token_stream(docs)  # [N] byte ids
    heldout = token_stream(C.read_corpus(["stdlib:heldout"])) if a.eval_heldout else None

    model, opt = _build_model(a)
    start, history, elapsed = 0, [], 0.0
    if a.resume and ckpt_path.is_file():
        start, history, elapsed = resume(ckpt_path, settings, model, "model", opt)
    elif not a.resume and ckpt_path.is_file():
        raise SystemExit(f"{ckpt_path} exists: pass --resume to continue it, or use a new --out")
    n_params = sum(p.numel() for p in model.parameters())
    log = Log(state_dir / "log.jsonl")
    if start == 0:
        log.write(event="start", params=n_params, corpus_tokens=stream.numel(), **settings)

    model.train()
    t0 = time.time()

    def checkpoint(step: int) -> None:
        atomic_save(
            {
                "step": step,
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "rng": torch.get_rng_state(),
                "history": history,
                "elapsed": elapsed + time.time() - t0,
                "settings": settings,
            },
            ckpt_path,
        )

    end = a.steps if stop_after is None else min(a.steps, stop_after)
    _run_steps(a, start, end, model, opt, stream, history, log, checkpoint)
    checkpoint(end)
    elapsed += time.time() - t0
    if end < a.steps:
        print(f"stopped at step {end}; continue with --resume", file=sys.stderr)
        return {"step": end}

    export(model, out, DTYPES[a.dtype])
    summary = _summary(a, history, n_params, elapsed, docs, stream, settings)
    if heldout is not None:
        summary["heldout_loss"] = round(eval_loss(model, heldout, a.seq_len), 4)
    atomic_write_text(state_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    log.write(event="done", **{k: v for k, v in summary.items() if k != "settings"})
    print(json.dumps({k: v for k, v in summary.items() if k != "settings"}))
    return summary


def _build_model(a: argparse.Namespace):
    """A freshly initialized Qwen3ForCausalLM (sdpa attention) and its AdamW."""
    from transformers import Qwen3ForCausalLM

    config = make_config(a)
    config._attn_implementation = "sdpa"  # training speed; the saved config is plain
    model = Qwen3ForCausalLM(config)
    init_weights(model)
    return model, adamw(model, a.lr, a.weight_decay)


def _run_steps(
    a: argparse.Namespace,
    start: int,
    end: int,
    model,
    opt: torch.optim.Optimizer,
    stream: torch.Tensor,
    history: list,
    log: Log,
    checkpoint,
) -> None:
    """Steps start … end−1, each on `a.batch_size` windows of `stream` drawn for that step:
    the scheduled lr, next-byte loss, backward, clip, AdamW. Appends the loss to `history`, logs
    the mean of the last 20 every 20 steps, checkpoints every `a.save_every` steps before `end`
    (the caller checkpoints `end`)."""
    from tqdm import tqdm

    bar = tqdm(range(start, end), initial=start, total=a.steps, desc="target", mininterval=2)
    for step in bar:
        lr = lr_at(step, a.steps, a.lr, a.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = windows(stream, a.batch_size, a.seq_len + 1, step_generator(a.seed, step))
        loss = lm_loss(model, batch)  # batch [batch_size, seq_len + 1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(loss.item())
        bar.set_postfix(loss=f"{sum(history[-20:]) / len(history[-20:]):.3f}", lr=f"{lr:.2e}")
        if (step + 1) % 20 == 0:
            log.write(step=step + 1, loss=sum(history[-20:]) / 20, lr=lr)
        if (step + 1) % a.save_every == 0 and step + 1 < end:
            checkpoint(step + 1)
    bar.close()


def _summary(
    a: argparse.Namespace,
    history: list,
    n_params: int,
    elapsed: float,
    docs: list[tuple[str, str]],
    stream: torch.Tensor,
    settings: dict,
) -> dict:
    """The run summary: final training loss (mean of the last 50 steps), corpus size, timing."""
    tail = history[-50:]
    return {
        "steps": a.steps,
        "params": n_params,
        "final_train_loss": round(sum(tail) / len(tail), 4),
        "wall_time_s": round(elapsed, 1),
        "corpus_files": len(docs),
        "corpus_bytes": int(stream.numel() - len(docs)),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "settings": settings,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_lab.train.target",
        description="Train a small byte-level Qwen3 target from scratch (CPU).",
    )
    p.add_argument("--corpus", nargs="+", default=["stdlib"], help="stdlib | files | dirs")
    p.add_argument("--out", required=True, help="Hugging Face directory to write")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="saved weights")
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state")
    p.add_argument("--stop-after", type=int, default=None, help="checkpoint and stop at this step")
    p.add_argument(
        "--no-eval-heldout",
        dest="eval_heldout",
        action="store_false",
        help="skip the held-out stdlib loss at the end",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    train(a, stop_after=a.stop_after)


if __name__ == "__main__":
    main()
