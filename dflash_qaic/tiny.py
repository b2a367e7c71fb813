"""Write a random tiny target + DFlash draft pair in the real on-disk formats.

    python -m dflash_qaic.tiny OUT [--family qwen3|llama] [--agree 3.0] ...
    dflash-make-tiny-pair OUT ...

`OUT/target` is a Hugging Face directory (config.json + model.safetensors), `OUT/draft` a DFlash
draft directory (config.json + model.safetensors, the 3 + 11·L layout).

A random draft almost never agrees with a random target, which leaves most of the decode loop
untested. `agree > 0` makes acceptance vary from 1 to B: the draft's final norm is zeroed, so it
always proposes token 0, and the target is biased toward token 0 (a constant offset on hidden
dimension 0 of every embedding row, which the residual stream carries to the head, plus an extra
`agree` on token 0's head row there), so the target picks 0 often but not always.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_qaic.checkpoints import default_target_layer_ids


@dataclass
class TinySpec:
    family: str = "qwen3"
    hidden_size: int = 64
    target_layers: int = 4
    draft_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_size: int = 256
    block_size: int = 8
    target_layer_ids: list[int] | None = None  # None: leave absent (the default rule applies)
    tie_word_embeddings: bool = True
    agree: float = 0.0
    seed: int = 0
    rope_theta: float = 10000.0


def _target_config(s: TinySpec):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.target_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=s.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if s.family == "qwen3":
        return Qwen3Config(**common)
    if s.family == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown family {s.family!r}: use 'qwen3' or 'llama'")


def draft_config_dict(s: TinySpec) -> dict:
    dflash = {"mask_token_id": s.vocab_size - 1, "block_size": s.block_size}
    if s.target_layer_ids is not None:
        dflash["target_layer_ids"] = list(s.target_layer_ids)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.draft_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": s.rope_theta,  # the published drafts' (pre-5.x) spelling
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": s.target_layers,
        "block_size": s.block_size,
        "dflash_config": dflash,
        "torch_dtype": "float32",
    }


def random_draft_state(s: TinySpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    H, hd, inter = s.hidden_size, s.head_dim, s.intermediate_size
    ids = s.target_layer_ids or default_target_layer_ids(s.target_layers, s.draft_layers)

    def w(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=gen) * scale

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    state = {
        "fc.weight": w(H, len(ids) * H),
        "hidden_norm.weight": norm(H),
        "norm.weight": torch.zeros(H) if s.agree > 0 else norm(H),
    }
    for i in range(s.draft_layers):
        p = f"layers.{i}."
        state.update(
            {
                p + "self_attn.q_proj.weight": w(s.num_heads * hd, H),
                p + "self_attn.k_proj.weight": w(s.num_kv_heads * hd, H),
                p + "self_attn.v_proj.weight": w(s.num_kv_heads * hd, H),
                p + "self_attn.o_proj.weight": w(H, s.num_heads * hd),
                p + "self_attn.q_norm.weight": norm(hd),
                p + "self_attn.k_norm.weight": norm(hd),
                p + "mlp.gate_proj.weight": w(inter, H),
                p + "mlp.up_proj.weight": w(inter, H),
                p + "mlp.down_proj.weight": w(H, inter),
                p + "input_layernorm.weight": norm(H),
                p + "post_attention_layernorm.weight": norm(H),
            }
        )
    return state


def make_tiny_pair(out_dir: str | Path, family: str = "qwen3", **kw) -> tuple[Path, Path]:
    """Write OUT/target and OUT/draft; returns their paths. Keyword args: fields of TinySpec."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    s = TinySpec(family=family, **kw)
    out = Path(out_dir)
    tdir, ddir = out / "target", out / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    ddir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed + 1)
    target = AutoModelForCausalLM.from_config(_target_config(s)).float().eval()
    with torch.no_grad():
        # Random init with a readable scale (HF's 0.02 std makes every logit nearly equal).
        for name, p in target.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        emb = target.get_input_embeddings().weight
        emb.mul_(4.0)
        if s.agree > 0:
            emb[:, 0] = 4.0  # a steady positive component the residual stream carries along
            head = target.get_output_embeddings().weight
            # token 0 leads whenever that component dominates; in units of a head row's norm
            head[0, 0] += s.agree * head.norm(dim=1).mean()
    target.save_pretrained(tdir)

    (ddir / "config.json").write_text(json.dumps(draft_config_dict(s), indent=2) + "\n")
    save_file(random_draft_state(s, gen), str(ddir / "model.safetensors"))
    return tdir, ddir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to write target/ and draft/ into")
    p.add_argument("--family", default="qwen3", choices=["qwen3", "llama"])
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--target-layers", type=int, default=4)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--untied", action="store_true", help="untie the target's lm_head")
    p.add_argument("--agree", type=float, default=0.0, help="bias toward agreement (see docs)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t, d = make_tiny_pair(
        a.out,
        family=a.family,
        hidden_size=a.hidden_size,
        target_layers=a.target_layers,
        draft_layers=a.draft_layers,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        head_dim=a.hidden_size // a.num_heads,
        vocab_size=a.vocab_size,
        block_size=a.block_size,
        tie_word_embeddings=not a.untied,
        agree=a.agree,
        seed=a.seed,
    )
    print(f"target: {t}\ndraft:  {d}")


if __name__ == "__main__":
    main()
