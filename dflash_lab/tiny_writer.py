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

from dflash_lab.tiny_forms import form_blocks, quantization_config, quantized_layout, stored
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


def _gpt_oss_layout(s) -> list[tuple[str, tuple, str]]:
    """A gpt-oss target in its published form: experts MXFP4 (`…_blocks` / `…_scales`, uint8),
    everything else in s.dtype (families/gpt_oss.py)."""
    V, H, hd, E = s.vocab_size, s.hidden_size, s.head_dim, s.num_experts
    q, kv, inter, g = s.num_heads * hd, s.num_kv_heads * hd, s.moe_intermediate_size, 32
    out = [("model.embed_tokens.weight", (V, H), "embed")]
    for i in range(s.target_layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,), "norm")]
        for proj, n, k in (("q", q, H), ("k", kv, H), ("v", kv, H), ("o", H, q)):
            out += [(p + f"self_attn.{proj}_proj.weight", (n, k), "linear")]
            out += [(p + f"self_attn.{proj}_proj.bias", (n,), "bias")]
        out += [(p + "self_attn.sinks", (s.num_heads,), "bias")]
        out += [(p + "post_attention_layernorm.weight", (H,), "norm")]
        out += [(p + "mlp.router.weight", (E, H), "linear"), (p + "mlp.router.bias", (E,), "bias")]
        for proj, rows, cols in (("gate_up", 2 * inter, H), ("down", H, inter)):
            x = p + f"mlp.experts.{proj}_proj"
            out += [(x + "_blocks", (E, rows, cols // g, g // 2), "blocks")]
            out += [(x + "_scales", (E, rows, cols // g), "scales")]
            out += [(x + "_bias", (E, rows), "bias")]
    out += [("model.norm.weight", (H,), "norm"), ("lm_head.weight", (V, H), "linear")]
    return out


# MXFP4 (dflash_qaic/mxfp4.py): uniform random E2M1 codes have an RMS of about 2.93; the block
# scale 2^(s − 127) then gives the values about the N(0, 1/in) of a Linear weight, ± 1 octave
E2M1_RMS = 2.93
MX_KINDS = ("blocks", "scales")


def mxfp4_exponent(cols: int) -> int:
    """The E8M0 exponent whose block values have about cols^-½ RMS."""
    return 127 + round(math.log2(cols**-0.5 / E2M1_RMS))


def random_mxfp4(E: int, rows: int, cols: int, gen: torch.Generator):
    """(blocks uint8 [E, rows, cols/32, 16], scales uint8 [E, rows, cols/32]) of random
    N(0, 1/cols)-like expert weights [E, rows, cols]."""
    G = cols // 32
    blocks = torch.randint(0, 256, (E, rows, G, 16), dtype=torch.uint8, generator=gen)
    scales = mxfp4_exponent(cols) + torch.randint(-1, 2, (E, rows, G), generator=gen)
    return blocks, scales.to(torch.uint8)


def make_gpt_oss(s, tdir: Path, ddir: Path, cfg, draft_state) -> None:
    """A tiny gpt-oss pair in memory, in the published on-disk form: the experts drawn as MXFP4
    codes and scales (so the model is exactly what the checkpoint dequantizes to), written as
    `…_blocks` / `…_scales` beside the other tensors in s.dtype; `quantization_config` mxfp4."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from dflash_qaic.mxfp4 import dequantize

    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed + 1)
    target = AutoModelForCausalLM.from_config(cfg).float().eval()  # experts unquantized
    packed = {}
    with torch.no_grad():
        for name, p in target.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                E, cols, rows = p.shape  # Hugging Face holds [E, in, out]
                packed[name] = random_mxfp4(E, rows, cols, gen)
                p.copy_(dequantize(*packed[name]).transpose(1, 2))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        emb = target.get_input_embeddings().weight
        emb.mul_(4.0)
        if s.agree > 0:  # as tiny.py's default writer
            emb[:, 0] = 4.0
            head = target.get_output_embeddings().weight
            head[0, 0] += s.agree * head.norm(dim=1).mean()
    dtype = DTYPES[s.dtype][1]
    state = {k: v.to(dtype).contiguous() for k, v in target.state_dict().items() if k not in packed}
    for name, (blocks, scales) in packed.items():
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    cfg.architectures, cfg.dtype = ["GptOssForCausalLM"], s.dtype
    cfg.save_pretrained(tdir)
    save_file(state, str(tdir / "model.safetensors"), metadata={"format": "pt"})
    draft = {k: v.to(dtype) for k, v in draft_state(s, gen).items()}
    save_file(draft, str(ddir / "model.safetensors"), metadata={"format": "pt"})


def target_layout(s) -> list[tuple[str, tuple, str]]:
    """(name, shape, kind) of every tensor of the target checkpoint, in Hugging Face's order."""
    family = families.get(s.family)
    special = {"hybrid": _hybrid_layout, "gemma4": _gemma4_layout, "mxfp4": _gpt_oss_layout}
    if family.tiny_layout == "expected":  # the family's own list (its expected shapes)
        return family.tiny_tensors(s)
    if family.tiny_layout in special:
        return special[family.tiny_layout](s)
    V, H = s.vocab_size, s.hidden_size
    out = [("model.embed_tokens.weight", (V, H), "embed")]
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
        if getattr(s, "attention_bias", False):  # the published gpt-oss drafts' q/k/v/o biases
            hd, p = s.head_dim, f"layers.{i}.self_attn."
            sizes = (s.num_heads * hd, s.num_kv_heads * hd, s.num_kv_heads * hd, H)
            out += [(p + f"{x}_proj.bias", (n,), "bias") for x, n in zip("qkvo", sizes)]
    return out


def _blocks(shape: tuple, kind: str, gen: torch.Generator):
    if stored(kind):  # a part of a quantized weight (tiny_forms.py)
        yield from form_blocks(shape, kind, gen, BLOCK_ELEMS)
        return
    if kind in MX_KINDS:  # MXFP4 codes [E, R, G, 16] or scales [E, R, G], uint8, by rows
        rows = math.prod(shape[:2])
        cols = math.prod(shape[2:])
        step = max(1, BLOCK_ELEMS // cols)
        for r0 in range(0, rows, step):
            n = (min(step, rows - r0), cols)
            if kind == "blocks":
                yield torch.randint(0, 256, n, dtype=torch.uint8, generator=gen)
            else:  # the block exponents of N(0, 1/in)-like values, in = 32 · G
                e = mxfp4_exponent(32 * shape[2]) + torch.randint(-1, 2, n, generator=gen)
                yield e.to(torch.uint8)
        return
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
        elif kind == "bias":
            yield 0.1 * x
        elif kind == "znorm":  # zero-centred norm weights: the scale is 1 + w
            yield 0.1 * x
        elif kind == "alog":  # log A with A in about [1, 16], as Hugging Face initialises it
            yield (1.0 + 0.5 * x).clamp(0.0, 2.77)
        else:
            yield x * (cols**-0.5) * (4.0 if kind == "embed" else 1.0)


def _stored(kind: str, dtype: str) -> tuple[str, torch.dtype]:
    """(safetensors dtype, torch dtype) a tensor of `kind` is written in."""
    if kind in MX_KINDS:
        return "U8", torch.uint8
    return stored(kind) or DTYPES[dtype]


def write_safetensors(path: Path, layout, dtype: str, gen: torch.Generator, bar=None) -> int:
    """Write one safetensors file of random tensors; returns its data bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, kind in layout:
        code, tdtype = _stored(kind, dtype)
        n = math.prod(shape) * tdtype.itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, shape, kind in layout:
            tdtype = _stored(kind, dtype)[1]
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
    t_layout = quantized_layout(target_layout(s), s.weight_format)
    d_layout = draft_layout(s)
    total = sum(math.prod(sh) * _stored(k, s.dtype)[1].itemsize for _, sh, k in t_layout)
    total += sum(math.prod(sh) * itemsize for _, sh, _ in d_layout)
    bar = tqdm(total=total, desc="writing random pair", unit="B", unit_scale=True, leave=False)
    target_config.dtype = s.dtype
    if s.weight_format != "plain":  # the published quantized forms (tiny_forms.py)
        target_config.quantization_config = quantization_config(s.weight_format)
    if getattr(s, "multimodal", False):  # the published form: the family's first architecture
        target_config.architectures = [families.get(s.family).architectures[0]]
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
