"""Write random checkpoints of any size tensor by tensor (used by `dflash_lab.tiny`).

Each safetensors file is written as: the header (every tensor's dtype, shape and offsets are
known up front), then each tensor's bytes, generated a block of rows at a time. Memory stays at
one block (≤ 64 MB) whatever the model size. Values follow tiny.py's recipe: Linear weights
N(0, 1/in), norms 1 + N(0, 0.01), the embedding 4·N(0, 1/H).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash_qaic import families
from dflash_qaic.checkpoint_files.safetensors import INDEX_NAME
from dflash_qaic.drafts import default_target_layer_ids
from dflash_qaic.families.qwen3_5 import TINY_VISION_TENSORS

DTYPES = {
    "float32": ("F32", torch.float32),
    "bfloat16": ("BF16", torch.bfloat16),
    "float16": ("F16", torch.float16),
}
BLOCK_ELEMS = 16 << 20


def _expert_tensors(s) -> list[tuple[str, tuple, str]]:
    """A sparse layer's router and experts (per expert, or fused when s.fused_experts)."""
    E, H, inter = s.num_experts, s.hidden_size, s.moe_intermediate_size
    out = [("mlp.gate.weight", (E, H), "linear")]
    if s.fused_experts:
        return out + [
            ("mlp.experts.gate_up_proj", (E, 2 * inter, H), "experts"),
            ("mlp.experts.down_proj", (E, H, inter), "experts"),
        ]
    for e in range(E):
        p = f"mlp.experts.{e}."
        out += [(p + "gate_proj.weight", (inter, H), "linear")]
        out += [(p + "up_proj.weight", (inter, H), "linear")]
        out += [(p + "down_proj.weight", (H, inter), "linear")]
    return out


def _sparse(s, i: int) -> bool:
    """Hugging Face's rule for a Qwen3-MoE layer having experts."""
    dense = [1] if s.mlp_only_layers is None else s.mlp_only_layers
    return i not in dense and (i + 1) % s.decoder_sparse_step == 0


def _layer_tensors(
    prefix: str, s, qk_norm: bool = True, sparse: bool = False
) -> list[tuple[str, tuple, str]]:
    H, hd, inter = s.hidden_size, s.head_dim, s.intermediate_size
    q, kv = s.num_heads * hd, s.num_kv_heads * hd
    out = [
        ("input_layernorm.weight", (H,), "norm"),
        ("self_attn.q_proj.weight", (q, H), "linear"),
        ("self_attn.k_proj.weight", (kv, H), "linear"),
        ("self_attn.v_proj.weight", (kv, H), "linear"),
        ("self_attn.o_proj.weight", (H, q), "linear"),
    ]
    if qk_norm:
        out += [
            ("self_attn.q_norm.weight", (hd,), "norm"),
            ("self_attn.k_norm.weight", (hd,), "norm"),
        ]
    out += [("post_attention_layernorm.weight", (H,), "norm")]
    if sparse:
        out += _expert_tensors(s)
    else:
        out += [
            ("mlp.gate_proj.weight", (inter, H), "linear"),
            ("mlp.up_proj.weight", (inter, H), "linear"),
            ("mlp.down_proj.weight", (H, inter), "linear"),
        ]
    return [(prefix + n, shape, kind) for n, shape, kind in out]


def _hybrid_layout(s) -> list[tuple[str, tuple, str]]:
    """A Qwen3.5 hybrid target (tiny.py's qwen3_5 family), in the published form when
    s.multimodal (text tensors under model.language_model.*, a token vision tower)."""
    V, H, inter = s.vocab_size, s.hidden_size, s.intermediate_size
    hd, nh, kvh = s.attn_head_dim or s.head_dim, s.attn_heads or s.num_heads, s.attn_kv_heads
    kvh = kvh or s.num_kv_heads
    kd, vd = s.linear_key_heads * s.linear_head_dim, s.linear_value_heads * s.linear_head_dim
    conv, hv = 2 * kd + vd, s.linear_value_heads
    p = "model.language_model." if s.multimodal else "model."
    out = [(p + "embed_tokens.weight", (V, H), "embed")]
    for i in range(s.target_layers):
        q = f"{p}layers.{i}."
        out.append((q + "input_layernorm.weight", (H,), "znorm"))
        if (i + 1) % s.full_attention_interval:
            la = q + "linear_attn."
            out += [
                (la + "in_proj_qkv.weight", (conv, H), "linear"),
                (la + "in_proj_z.weight", (vd, H), "linear"),
                (la + "in_proj_b.weight", (hv, H), "linear"),
                (la + "in_proj_a.weight", (hv, H), "linear"),
                (la + "conv1d.weight", (conv, 1, s.conv_kernel), "linear"),
                (la + "A_log", (hv,), "alog"),
                (la + "dt_bias", (hv,), "norm"),
                (la + "norm.weight", (s.linear_head_dim,), "norm"),
                (la + "out_proj.weight", (H, vd), "linear"),
            ]
        else:
            sa = q + "self_attn."
            out += [
                (sa + "q_proj.weight", (2 * nh * hd, H), "linear"),
                (sa + "k_proj.weight", (kvh * hd, H), "linear"),
                (sa + "v_proj.weight", (kvh * hd, H), "linear"),
                (sa + "o_proj.weight", (H, nh * hd), "linear"),
                (sa + "q_norm.weight", (hd,), "znorm"),
                (sa + "k_norm.weight", (hd,), "znorm"),
            ]
        out += [
            (q + "post_attention_layernorm.weight", (H,), "znorm"),
            (q + "mlp.gate_proj.weight", (inter, H), "linear"),
            (q + "mlp.up_proj.weight", (inter, H), "linear"),
            (q + "mlp.down_proj.weight", (H, inter), "linear"),
        ]
    out.append((p + "norm.weight", (H,), "znorm"))
    if s.multimodal:
        out += [(k, shape, "linear") for k, shape in TINY_VISION_TENSORS.items()]
    if not s.tie_word_embeddings:
        out.append(("lm_head.weight", (V, H), "linear"))
    return out


def _gemma4_layout(s) -> list[tuple[str, tuple, str]]:
    """A Gemma 4 target (tiny.py's gemma4 family, e.g. --preset gemma-4-31b): every tensor its
    program reads (kind_checkpoints.gemma4_shapes), in the published form when s.multimodal
    (text tensors under model.language_model.*; the towers, which no program reads, left out).
    Norms and layer scalars near 1 (Gemma's RMSNorm is x̂·w)."""
    from dflash_qaic.kind_checkpoints import gemma4_shapes

    cfg = families.get(s.family).tiny_config(s)
    text = getattr(cfg, "text_config", cfg).to_dict()
    prefix = "model.language_model." if s.multimodal else "model."
    out = []
    for name, shape in gemma4_shapes(text, prefix, s.tie_word_embeddings).items():
        if name.endswith("embed_tokens.weight"):
            kind = "embed"
        elif name.endswith(("norm.weight", "layer_scalar", "router.scale")) or len(shape) == 1:
            kind = "norm"
        else:
            kind = "experts" if len(shape) == 3 else "linear"
        out.append((name, tuple(shape), kind))
    return out


def target_layout(s) -> list[tuple[str, tuple, str]]:
    """(name, shape, kind) of every tensor of the target checkpoint, in Hugging Face's order."""
    if s.family == "qwen3_5":
        return _hybrid_layout(s)
    if s.family in ("gemma4", "gemma4_moe"):
        return _gemma4_layout(s)
    V, H = s.vocab_size, s.hidden_size
    out = [("model.embed_tokens.weight", (V, H), "embed")]
    family = families.get(s.family)
    for i in range(s.target_layers):
        sparse = family.moe and _sparse(s, i)
        out += _layer_tensors(f"model.layers.{i}.", s, qk_norm=family.qk_norm, sparse=sparse)
    out.append(("model.norm.weight", (H,), "norm"))
    if not s.tie_word_embeddings:
        out.append(("lm_head.weight", (V, H), "linear"))
    return out


def draft_layout(s) -> list[tuple[str, tuple, str]]:
    """The z-lab draft layout: fc, hidden_norm, norm and 11 tensors per layer."""
    ids = s.target_layer_ids or default_target_layer_ids(s.target_layers, s.draft_layers)
    H = s.hidden_size
    out = [
        ("fc.weight", (H, len(ids) * H), "linear"),
        ("hidden_norm.weight", (H,), "norm"),
        ("norm.weight", (H,), "norm"),
    ]
    for i in range(s.draft_layers):
        out += _layer_tensors(f"layers.{i}.", s)
    return out


def _blocks(shape: tuple, kind: str, gen: torch.Generator):
    if kind == "experts":  # stacked [E, out, in] matrices: each an N(0, 1/in) Linear weight
        for _ in range(shape[0]):
            yield from _blocks(shape[1:], "linear", gen)
        return
    rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, shape[0])
    step = max(1, BLOCK_ELEMS // cols)
    for r0 in range(0, rows, step):
        x = torch.randn(min(step, rows - r0), cols, generator=gen)
        if kind == "norm":
            yield 1.0 + 0.1 * x
        elif kind == "znorm":  # zero-centred norm weights: the scale is 1 + w
            yield 0.1 * x
        elif kind == "alog":  # log A with A in about [1, 16], as Hugging Face initialises it
            yield (1.0 + 0.5 * x).clamp(0.0, 2.77)
        else:
            yield x * (cols**-0.5) * (4.0 if kind == "embed" else 1.0)


def write_safetensors(path: Path, layout, dtype: str, gen: torch.Generator, bar=None) -> int:
    """Write one safetensors file of random tensors; returns its data bytes."""
    code, tdtype = DTYPES[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in layout:
        n = math.prod(shape) * tdtype.itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, shape, kind in layout:
            for block in _blocks(shape, kind, gen):
                data = block.to(tdtype).contiguous()
                f.write(memoryview(data.view(torch.uint8).numpy()))
                if bar is not None:
                    bar.update(data.numel() * tdtype.itemsize)
    return offset


def _shard(layout, n: int, itemsize: int) -> list[list]:
    """Split the layout, in order, into n shards of about equal bytes."""
    sizes = [math.prod(shape) * itemsize for _, shape, _ in layout]
    total, shards, cum = sum(sizes), [[] for _ in range(n)], 0
    for entry, size in zip(layout, sizes):
        shards[min(n - 1, int(n * cum / total))].append(entry)
        cum += size
    return [sh for sh in shards if sh]


def write_pair_streamed(s, tdir: Path, ddir: Path, target_config) -> None:
    """The target (sharded with an index when s.shards > 1) and the draft (one file)."""
    if s.agree:
        raise ValueError("`agree` needs the default writer (fp32, one file, no preset)")
    if s.dtype not in DTYPES:
        raise ValueError(f"dtype {s.dtype!r}: choose from {', '.join(DTYPES)}")
    gen = torch.Generator().manual_seed(s.seed + 1)
    itemsize = DTYPES[s.dtype][1].itemsize
    t_layout, d_layout = target_layout(s), draft_layout(s)
    total = sum(math.prod(sh) * itemsize for _, sh, _ in t_layout + d_layout)
    bar = tqdm(total=total, desc="writing random pair", unit="B", unit_scale=True, leave=False)
    target_config.dtype = s.dtype
    if getattr(s, "multimodal", False):
        target_config.architectures = ["Qwen3_5ForConditionalGeneration"]
        if s.family in ("gemma4", "gemma4_moe"):  # the published Gemma 4 form
            target_config.architectures = ["Gemma4ForConditionalGeneration"]
    target_config.save_pretrained(tdir)
    shards = _shard(t_layout, s.shards, itemsize) if s.shards > 1 else [t_layout]
    if len(shards) == 1:
        write_safetensors(tdir / "model.safetensors", t_layout, s.dtype, gen, bar)
    else:
        weight_map, size = {}, 0
        for i, layout in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            size += write_safetensors(tdir / name, layout, s.dtype, gen, bar)
            weight_map.update({n: name for n, _, _ in layout})
        index = {"metadata": {"total_size": size}, "weight_map": weight_map}
        (tdir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    write_safetensors(ddir / "model.safetensors", d_layout, s.dtype, gen, bar)
    bar.close()
