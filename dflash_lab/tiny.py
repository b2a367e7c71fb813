"""Write a random target + DFlash draft pair in the real on-disk formats, tiny or real-sized.

    python -m dflash_lab.tiny OUT [--family qwen3|llama] [--agree 3.0] ...
    dflash-make-tiny-pair OUT ...
    dflash-make-tiny-pair OUT --preset qwen3-4b        # Qwen3-4B shapes, bf16, 3 shards + index
    dflash-make-tiny-pair OUT --layer-types sliding,full --sliding-window 64 [--is-causal false]
        [--input-embedding-scale S] [--output-multiplier M] [--final-logit-softcapping C]
    dflash-make-tiny-pair OUT --draft-form dflash2 [--conv-kernel-size K] [--selector-top-k k]

    dflash-make-tiny-pair OUT --family qwen3_moe       # 8 experts, top-2, layer 1 dense
    dflash-make-tiny-pair OUT --preset qwen3-30b-a3b   # Qwen3-30B-A3B layers (4 of them), bf16
    dflash-make-tiny-pair OUT --family gpt_oss         # MXFP4 experts, sinks, sliding + full
    dflash-make-tiny-pair OUT --preset gpt-oss-20b --target-layers 4   # its first 4 layers
    dflash-make-tiny-pair OUT --family deepseek_v3     # latent attention, grouped routed experts
    dflash-make-tiny-pair OUT --family minimax_m2      # partial RoPE, sigmoid routing
    dflash-make-tiny-pair OUT --preset kimi-k2.5 --num-layers 3 --num-experts 16  # bf16

`OUT/target` is a Hugging Face directory (config.json + model.safetensors, or shards
model-0000i-of-0000n.safetensors with model.safetensors.index.json), `OUT/draft` a DFlash draft
directory (config.json + model.safetensors, the 3 + 11·L layout, no embedding or head).

A default spec (fp32, one file) goes through Hugging Face's `save_pretrained`. Any other dtype,
a sharded target or a preset is written tensor by tensor (random values generated a block of
rows at a time, straight into the file), so a real-sized pair needs little memory.

A random draft almost never agrees with a random target, which leaves most of the decode loop
untested. `agree > 0` makes acceptance vary from 1 to B: the draft's final norm is zeroed, so it
always proposes token 0, and the target is biased toward token 0 (a constant offset on hidden
dimension 0 of every embedding row, which the residual stream carries to the head, plus an extra
`agree` on token 0's head row there), so the target picks 0 often but not always.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_lab.tiny_forms import check_format
from dflash_qaic import families
from dflash_qaic.drafts import default_target_layer_ids
from dflash_qaic.families.base import TinyFields
from dflash_qaic.families.qwen3_5 import TINY_VISION_TENSORS


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
    # None: the published default rule, left absent from the config, when it gives distinct
    # layers; else (a target too shallow for it, as the default 4 layers) spread, written down
    target_layer_ids: list[int] | None = None
    tie_word_embeddings: bool = True
    agree: float = 0.0
    seed: int = 0
    rope_theta: float = 10000.0
    dtype: str = "float32"  # float32 | bfloat16 | float16 (of both checkpoints)
    shards: int = 1  # > 1: the target in that many shards with model.safetensors.index.json
    mask_token_id: int | None = None  # None: vocab_size - 1
    max_position_embeddings: int = 4096
    # newer draft forms (None: absent from the draft config, the b16 form)
    layer_types: list[str] | None = None  # per draft layer: full_attention | sliding_attention
    sliding_window: int | None = None
    is_causal: bool | None = None
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    # "dflash2": a DFlash2DraftModel (convs around attention and MLP, a candidate selector;
    # its fields in dflash_config, the selector's tensors without `.weight`, as published)
    draft_form: str = "dflash"
    conv_kernel_size: int = 3
    conv_group_size: int = 16
    selector_rank: int = 4
    selector_top_k: int = 4
    # the draft's q/k/v/o biases (`attention_bias`, as the published gpt-oss drafts have)
    attention_bias: bool = False
    weight_format: str = "plain"  # fp8 | int4: published quantized forms (tiny_forms.py)
    # the fields only the family's tiny pairs have (families/: `Family.tiny_fields`), read as
    # the spec's own (s.num_experts); None: the family's defaults
    fields: TinyFields | None = None

    def __post_init__(self):
        if self.fields is None:
            self.fields = families.get(self.family).tiny_fields()
        check_format(self)  # the published quantized forms (tiny_forms.py)

    def __getattr__(self, name: str):
        fields = self.__dict__.get("fields")
        if fields is not None and name in {f.name for f in dataclasses.fields(fields)}:
            return getattr(fields, name)
        raise AttributeError(f"a {self.__dict__.get('family')} tiny pair has no field {name!r}")

    @classmethod
    def of(cls, family: str = "qwen3", **kw) -> TinySpec:
        """The spec of a `family` tiny pair from keyword fields: TinySpec's and the family's
        own (`Family.tiny_fields`); a field of neither is refused, naming the family's."""
        own_type = families.get(family).tiny_fields
        own = {f.name for f in dataclasses.fields(own_type)}
        common = {f.name for f in dataclasses.fields(cls)} - {"fields"}
        unknown = sorted(set(kw) - own - common)
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)}: not a field of a {family} tiny pair (its own fields: "
                f"{', '.join(sorted(own)) or 'none'})"
            )
        fields = own_type(**{k: v for k, v in kw.items() if k in own})
        return cls(family=family, fields=fields, **{k: v for k, v in kw.items() if k in common})

    @property
    def streamed(self) -> bool:
        """Written tensor by tensor (dflash_lab/tiny_writer.py) rather than save_pretrained."""
        plain = self.dtype == "float32" and self.shards == 1 and self.weight_format == "plain"
        return not plain or self.fields.streamed()


# DeepSeek-V3's latent attention and expert shapes (DeepSeek-V3, Kimi K2.x): H 7168, q LoRA 1536,
# latent 512, RoPE key 64 (the draft's head_dim), nope 128, v 128, dense MLP 18432, experts 2048
_DEEPSEEK_ATTENTION = dict(
    hidden_size=7168,
    draft_layers=2,
    intermediate_size=18432,
    head_dim=64,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    v_head_dim=128,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    tie_word_embeddings=False,
    shards=4,
)

# Published shapes (Qwen3-0.6B / Qwen3-4B and z-lab's 5-layer b16 drafts for them): bf16, the
# target sharded with an index and its head tied, the draft's target layers by the default rule.
PRESETS: dict[str, dict] = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        target_layers=28,
        intermediate_size=3072,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
    ),
    "qwen3-4b": dict(
        hidden_size=2560,
        target_layers=36,
        intermediate_size=9728,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        shards=3,
    ),
    # Qwen3.5-4B's text model in its published multimodal form (bf16, sharded, untied head),
    # with a 5-layer b16-style draft of Qwen3-4B's attention shape (no vision tensors beyond a
    # token few: the exporter ignores them)
    "qwen3.5-4b": dict(
        family="qwen3_5",
        hidden_size=2560,
        target_layers=32,
        intermediate_size=9216,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        attn_heads=16,
        attn_kv_heads=4,
        attn_head_dim=256,
        linear_key_heads=16,
        linear_value_heads=32,
        linear_head_dim=128,
        vocab_size=248320,
        mask_token_id=248077,
        tie_word_embeddings=False,
        multimodal=True,
        shards=4,
        max_position_embeddings=262144,
        rope_theta=10000000.0,
    ),
    # Qwen3-30B-A3B's layers (Qwen3-Coder-30B-A3B has the same), 4 of its 48: untied head,
    # 128 experts of 768, top-8, every layer sparse
    "qwen3-30b-a3b": dict(
        family="qwen3_moe",
        hidden_size=2048,
        target_layers=4,
        draft_layers=2,
        target_layer_ids=[1, 2],
        intermediate_size=6144,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        shards=3,
    ),
    # Gemma 4 31B-it's text model in its published form (Gemma4ForConditionalGeneration, text
    # tensors under model.language_model.*, bf16, sharded, tied head; REFERENCE facts in
    # docs/DESIGN.md, Layer kinds): 60 layers, 5 sliding : 1 full, the last full; a Qwen3-shaped
    # draft of the sliding layers' attention shape with Gemma's √H input scale and soft-cap 30.
    # `--num-layers N` keeps the first N layers (the pattern, the last made full)
    "gemma-4-31b": dict(
        family="gemma4",
        hidden_size=5376,
        target_layers=60,
        intermediate_size=21504,
        num_heads=32,
        num_kv_heads=16,
        head_dim=256,
        global_head_dim=512,
        num_global_kv_heads=4,
        target_sliding_window=512,
        vocab_size=262144,
        mask_token_id=4,
        multimodal=True,
        shards=4,
        max_position_embeddings=262144,
        rope_theta=1000000.0,
        input_embedding_scale=5376**0.5,
        final_logit_softcapping=30.0,
    ),
    # gpt-oss-20b: 24 layers of H 2880, 32 experts of 2880 (top-4) in MXFP4, alternating
    # sliding (128) and full attention, untied head, vocabulary 201,088; its DFlash draft as
    # z-lab's (block 8, mask token 200000, target layers 1, 6, 11, 16, 21, attention biases).
    # `--target-layers N` keeps the first N layers (the layers that fit).
    "gpt-oss-20b": dict(
        family="gpt_oss",
        hidden_size=2880,
        target_layers=24,
        draft_layers=5,
        intermediate_size=7680,  # the draft MLP (assumed; the target experts: moe_intermediate_size)
        num_heads=64,
        num_kv_heads=8,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=2880,
        target_sliding_window=128,
        attention_bias=True,
        vocab_size=201088,
        mask_token_id=200000,
        block_size=8,
        tie_word_embeddings=False,
        rope_theta=150000.0,
        max_position_embeddings=131072,
        shards=3,
    ),
    # DeepSeek-V3 (and R1): 61 layers of H 7168, multi-head latent attention (128 heads, q LoRA
    # 1536, latent 512 + RoPE key 64, nope 128, v 128), the first 3 layers dense (18432), then
    # 256 routed experts of 2048 (top-8 in 4 of 8 groups, scaled 2.5) beside one shared, YaRN
    # ×40 with mscale, untied head, vocabulary 129,280; written bf16 (the published FP8 form
    # is another writer's). The draft (assumed: z-lab publishes none for V3) is Qwen3-shaped with
    # the target's head shape, 2 layers. `--num-layers N` keeps the first N target layers.
    "deepseek-v3": dict(
        _DEEPSEEK_ATTENTION,
        family="deepseek_v3",
        target_layers=61,
        num_heads=128,
        num_kv_heads=128,
        num_experts=256,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        routed_scaling_factor=2.5,
        vocab_size=129280,
        mask_token_id=129279,  # assumed: the last id
        rope_theta=10000.0,
        yarn_factor=40.0,
        max_position_embeddings=163840,
    ),
    # Kimi K2.5's text model (the DeepSeek-V3 architecture, text-only form; its published
    # wrapper is the kimi_k25 family: --family kimi_k25 --multimodal): 61 layers, 64 heads, 384 routed
    # experts (top-8, one group, scaled 2.827) beside one shared, the first layer dense, YaRN
    # ×64 (θ 50000), vocabulary 163,840. The draft as deepseek-v3's (assumed shape).
    "kimi-k2.5": dict(
        _DEEPSEEK_ATTENTION,
        family="deepseek_v3",
        target_layers=61,
        num_heads=64,
        num_kv_heads=64,
        num_experts=384,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        vocab_size=163840,
        mask_token_id=163839,  # assumed: the last id
        rope_theta=50000.0,
        yarn_factor=64.0,
        max_position_embeddings=262144,
    ),
    # MiniMax-M2.5: 62 layers of H 3072, 48 query / 8 KV heads of 128 (RoPE on the first 64),
    # q/k norm over the projection, 256 experts of 1536 (top-8, sigmoid with the correction
    # bias), untied head, vocabulary 200,064, θ 5e6. The draft: 2 Qwen3-shaped layers of the
    # target's head shape (assumed); `--num-layers N` keeps the first N target layers.
    "minimax-m2.5": dict(
        family="minimax_m2",
        hidden_size=3072,
        target_layers=62,
        draft_layers=2,
        intermediate_size=1536,
        num_heads=48,
        num_kv_heads=8,
        head_dim=128,
        rotary_dim=64,
        num_experts=256,
        num_experts_per_tok=8,
        vocab_size=200064,
        mask_token_id=200063,  # assumed: the last id
        tie_word_embeddings=False,
        rope_theta=5000000.0,
        max_position_embeddings=196608,
        shards=3,
    ),
}
_PRESET_COMMON = dict(
    family="qwen3",
    draft_layers=5,
    vocab_size=151936,
    block_size=16,
    mask_token_id=151669,
    tie_word_embeddings=True,
    dtype="bfloat16",
    shards=2,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
)


def preset_spec(name: str, **overrides) -> TinySpec:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose from {', '.join(PRESETS)}")
    kw = {**_PRESET_COMMON, **PRESETS[name], **overrides}
    kw.setdefault("target_layer_ids", None)
    if kw["target_layer_ids"] is None:  # the published drafts' layers (gpt-oss), else the rule
        kw["target_layer_ids"] = families.get(kw["family"]).draft_layer_ids(kw["target_layers"])
    if kw["target_layer_ids"] is None:  # the default rule; spread by _layer_ids when it repeats
        ids = default_target_layer_ids(kw["target_layers"], kw["draft_layers"])
        kw["target_layer_ids"] = ids if len(set(ids)) == len(ids) else None
    return TinySpec.of(**kw)


def _target_config(s: TinySpec):
    """The transformers config of the spec's target: its family's (dflash_qaic/families/)."""
    return families.get(s.family).tiny_config(s)


def _randomize_hybrid(target, s: TinySpec, gen: torch.Generator) -> None:
    """HF's init but with readable scales: zero-centred norms near 0, the gated norm near 1,
    Linear weights N(0, 1/in), conv N(0, 1/K); A_log and dt_bias keep HF's init."""
    for name, p in target.named_parameters():
        if name.endswith(("A_log", "dt_bias")):
            continue
        if name.endswith("linear_attn.norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("norm.weight"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def _save_hybrid(target, s: TinySpec, tdir: Path, gen: torch.Generator) -> None:
    """The text-only form through save_pretrained; the published form by hand: config.json of
    Qwen3_5ForConditionalGeneration, text tensors under model.language_model.*, a token vision
    tower, lm_head at the top, in s.dtype, sharded with an index when s.shards > 1."""
    from safetensors.torch import save_file

    from dflash_qaic.checkpoint_files.safetensors import INDEX_NAME

    if not s.multimodal:
        total = sum(p.numel() for p in target.parameters()) * getattr(torch, s.dtype).itemsize
        shard = f"{max(1, total // max(s.shards, 1) // 1000 + 1)}KB"
        target.to(getattr(torch, s.dtype)).save_pretrained(tdir, max_shard_size=shard)
        return
    cfg = _target_config(s)
    cfg.architectures = [families.get(s.family).architectures[0]]  # the multimodal form
    cfg.dtype = s.dtype
    cfg.save_pretrained(tdir)
    dtype = getattr(torch, s.dtype)
    state = {}
    for k, v in target.state_dict().items():
        if s.tie_word_embeddings and k == "lm_head.weight":
            continue
        name = k if k.startswith("lm_head") else "model.language_model." + k[len("model.") :]
        state[name] = v.detach().to(dtype).contiguous()
    for k, shape in TINY_VISION_TENSORS.items():
        state[k] = torch.randn(shape, generator=gen).to(dtype)
    names = list(state)
    n = max(1, min(s.shards, len(names)))
    groups = [names[i * len(names) // n : (i + 1) * len(names) // n] for i in range(n)]
    if n == 1:
        save_file(state, str(tdir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file({k: state[k] for k in group}, str(tdir / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, fname)
    index = {"metadata": {"total_size": sum(v.nbytes for v in state.values())}}
    (tdir / INDEX_NAME).write_text(json.dumps({**index, "weight_map": weight_map}, indent=2))


def draft_config_dict(s: TinySpec) -> dict:
    mask = s.vocab_size - 1 if s.mask_token_id is None else s.mask_token_id
    dflash = {"mask_token_id": mask, "block_size": s.block_size}
    if s.target_layer_ids is not None:
        dflash["target_layer_ids"] = list(s.target_layer_ids)
    for key in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        if getattr(s, key) is not None:
            dflash[key] = getattr(s, key)
    attention = {}
    if s.layer_types is not None:  # use_sliding_window: else transformers drops the window
        attention = {"layer_types": list(s.layer_types), "use_sliding_window": True}
        attention["sliding_window"] = s.sliding_window
    if s.is_causal is not None:
        attention["is_causal"] = s.is_causal
    arch = "DFlashDraftModel"
    if s.draft_form == "dflash2":
        arch = "DFlash2DraftModel"
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            dflash[key] = getattr(s, key)
    return {
        "architectures": [arch],
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
        "max_position_embeddings": s.max_position_embeddings,
        "attention_bias": s.attention_bias,
        "tie_word_embeddings": False,
        "num_target_layers": s.target_layers,
        "block_size": s.block_size,
        "dflash_config": dflash,
        "torch_dtype": s.dtype,
        **attention,
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
    if s.agree > 0 and s.draft_form == "dflash2":  # a zero norm would tie every logit (the
        # selector's top-k would then depend on tie-breaking): keep the embedding's dim-0
        # offset, which the target's head turns into a lead of token 0, and a little noise
        state["norm.weight"] = 0.05 * torch.randn(H, generator=gen)
        state["norm.weight"][0] = 1.0
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
        if s.draft_form == "dflash2":  # base kernels near the identity, small dynamic parts
            for conv in ("attention_conv", "mlp_conv"):
                base = 0.3 * torch.randn(2, s.conv_kernel_size, H, generator=gen)
                base[:, 0] += 1.0
                state[p + f"{conv}.base_kernel"] = base
                groups = H // s.conv_group_size
                state[p + f"{conv}.kernel_projection.weight"] = w(
                    2 * s.conv_kernel_size * groups, H, scale=0.3 * H**-0.5
                )
    if s.attention_bias:  # q/k/v/o biases (the published gpt-oss drafts')
        for i in range(s.draft_layers):
            p = f"layers.{i}.self_attn."
            for proj, n in zip(
                "qkvo", (s.num_heads * hd, s.num_kv_heads * hd, s.num_kv_heads * hd, H)
            ):
                state[p + f"{proj}_proj.bias"] = 0.1 * torch.randn(n, generator=gen)
    if s.draft_form == "dflash2":  # codebooks without `.weight`, as the reference's loader
        r = s.selector_rank  # maps them; pair scores of the size of logit gaps
        state["candidate_selector.hidden_projection.weight"] = w(r, H)
        state["candidate_selector.predecessor_codebook"] = w(s.vocab_size, r, scale=1.0)
        state["candidate_selector.successor_codebook"] = w(s.vocab_size, r, scale=1.0)
    return state


def _layer_ids(s: TinySpec) -> TinySpec:
    """The spec with target layers the exporter takes: distinct layers of the target."""
    L, D = s.target_layers, s.draft_layers
    flags = "--target-layers / --draft-layers (target_layers / draft_layers)"
    if s.target_layer_ids is not None:
        ids = list(s.target_layer_ids)
        if len(set(ids)) != len(ids) or not all(0 <= i < L for i in ids):
            raise ValueError(
                f"target_layer_ids {ids} must be distinct layers of the {L}-layer target "
                f"(0 … {L - 1}): fix them, or leave them out for the default rule"
            )
        return s
    ids = default_target_layer_ids(L, D)
    if len(set(ids)) == len(ids) and all(0 <= i < L for i in ids):
        return s  # left absent: the reader applies the same rule
    if D > L:
        raise ValueError(
            f"a {D}-layer draft reads {D} distinct target layers but the target has {L}: give "
            f"{flags} with at least as many target layers as draft layers"
        )
    lo = 1 if D < L else 0  # as the published rule, from layer 1 when there is room
    span = L - 1 - lo
    return dataclasses.replace(s, target_layer_ids=[lo + i * span // (D - 1) for i in range(D)])


def make_tiny_pair(
    out_dir: str | Path, family: str = "qwen3", *, preset: str | None = None, **kw
) -> tuple[Path, Path]:
    """Write OUT/target and OUT/draft; returns their paths. Keyword args: fields of TinySpec
    (over the preset's, when `preset` names one of PRESETS, else over the family's tiny preset:
    `make_tiny_pair(out, family=f.name)` for each `f` of `families.all()` is one tiny pair per
    family)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if preset:
        s = preset_spec(preset, **kw)
    else:  # the family's tiny preset (families/: Family.tiny) under the caller's fields
        s = TinySpec.of(family, **{**families.get(family).tiny, **kw})
    s = _layer_ids(s)
    out = Path(out_dir)
    tdir, ddir = out / "target", out / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    ddir.mkdir(parents=True, exist_ok=True)
    layout = families.get(s.family).tiny_layout
    if layout == "hybrid" and not preset:
        _make_hybrid(s, tdir, ddir)
        return tdir, ddir
    if layout == "mxfp4" and not preset:
        from dflash_lab.tiny_writer import make_gpt_oss

        make_gpt_oss(s, tdir, ddir, _target_config(s), random_draft_state)
        (ddir / "config.json").write_text(json.dumps(draft_config_dict(s), indent=2) + "\n")
        return tdir, ddir
    if preset or s.streamed:
        if s.draft_form != "dflash":
            raise ValueError(f"draft form {s.draft_form!r} is written only as a tiny fp32 pair")
        from dflash_lab.tiny_writer import write_pair_streamed

        write_pair_streamed(s, tdir, ddir, _target_config(s))
        (ddir / "config.json").write_text(json.dumps(draft_config_dict(s), indent=2) + "\n")
        return tdir, ddir

    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed + 1)
    cfg = _target_config(s)
    wrapper = families.get(s.family).text_model  # built as its text model, saved as wrapped
    target = AutoModelForCausalLM.from_config(cfg.get_text_config() if wrapper else cfg)
    target = target.float().eval()
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
    if wrapper:
        _save_wrapped(s, cfg, target, tdir, gen)
    else:
        target.save_pretrained(tdir)

    (ddir / "config.json").write_text(json.dumps(draft_config_dict(s), indent=2) + "\n")
    save_file(random_draft_state(s, gen), str(ddir / "model.safetensors"))
    return tdir, ddir


def _save_wrapped(s: TinySpec, cfg, target, tdir: Path, gen: torch.Generator) -> None:
    """A text model saved in its family's wrapper form (Kimi K2.5's): Hugging Face's saved
    tensors (experts per expert, as published) under the family's prefix and head name, beside
    the tiny vision tower's when s.multimodal."""
    import tempfile

    from safetensors.torch import load_file, save_file

    family = families.get(s.family)
    with tempfile.TemporaryDirectory(prefix="dflash-wrapped-") as tmp:
        target.save_pretrained(tmp)
        state = load_file(str(Path(tmp) / "model.safetensors"))
    cfg.save_pretrained(tdir)
    prefix = family.text_config(cfg.to_dict(), tdir / "config.json")[1]
    out = {family.head if k == "lm_head.weight" else prefix + k[len("model.") :]: v
           for k, v in state.items()}  # fmt: skip
    want = {n: sh for n, sh, _ in family.tiny_tensors(s)}
    out |= {n: torch.randn(sh, generator=gen) * 0.02 for n, sh in want.items() if n not in out}
    save_file(out, str(tdir / "model.safetensors"), metadata={"format": "pt"})


def _make_hybrid(s: TinySpec, tdir: Path, ddir: Path) -> None:
    """A tiny hybrid pair in memory (any dtype, either form, sharded or not)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed + 1)
    cfg = _target_config(s)
    target = AutoModelForCausalLM.from_config(getattr(cfg, "text_config", cfg)).float().eval()
    with torch.no_grad():
        _randomize_hybrid(target, s, gen)
        emb = target.get_input_embeddings().weight
        emb.mul_(4.0)
        if s.agree > 0:
            emb[:, 0] = 4.0
            head = target.get_output_embeddings().weight
            head[0, 0] += s.agree * head.norm(dim=1).mean()
    _save_hybrid(target, s, tdir, gen)
    (ddir / "config.json").write_text(json.dumps(draft_config_dict(s), indent=2) + "\n")
    state = {k: v.to(getattr(torch, s.dtype)) for k, v in random_draft_state(s, gen).items()}
    save_file(state, str(ddir / "model.safetensors"))


def _layer_types(text: str) -> list[str]:
    names = {"sliding": "sliding_attention", "full": "full_attention"}
    out = [names.get(t.strip(), t.strip()) for t in text.split(",")]
    if set(out) - set(names.values()):
        raise argparse.ArgumentTypeError(f"layer types are sliding or full, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to write target/ and draft/ into")
    p.add_argument("--preset", choices=sorted(PRESETS), help="published shapes (bf16, sharded)")
    p.add_argument(
        "--family", choices=families.names(), help="the target's (dflash_qaic/families/)"
    )
    p.add_argument(
        "--multimodal",
        action="store_true",
        help="qwen3_5 / gemma4: the published ConditionalGeneration form (text_config); "
        "kimi_k25: its wrapper with a tiny vision tower's tensors (skipped by the export)",
    )
    for flag in ("hidden-size", "target-layers", "draft-layers", "num-heads", "num-kv-heads"):
        p.add_argument(f"--{flag}", type=int)
    for flag in ("head-dim", "intermediate-size", "vocab-size", "block-size", "mask-token-id"):
        p.add_argument(f"--{flag}", type=int)
    for flag in ("num-experts", "num-experts-per-tok", "moe-intermediate-size"):
        p.add_argument(f"--{flag}", type=int, help="qwen3_moe")
    p.add_argument("--fused-experts", action="store_true", help="qwen3_moe: fused expert tensors")
    p.add_argument(
        "--weight-format", choices=["fp8", "int4"], help="FP8 block-scaled / INT4 experts"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--shards", type=int, help="split the target into N shards with an index")
    p.add_argument("--untied", action="store_true", help="untie the target's lm_head")
    p.add_argument("--agree", type=float, default=0.0, help="bias toward agreement (see docs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-layers",
        type=int,
        dest="target_layers",
        help="--preset: keep the first N target layers (gemma-4-31b: 5 sliding : 1 full, the "
        "last full, e.g. 6 for the layers that fit; kimi-k2.5 / deepseek-v3: the dense "
        "layers first)",
    )
    d = p.add_argument_group("newer draft forms")
    d.add_argument(
        "--layer-types",
        type=_layer_types,
        help="per draft layer, comma-separated: sliding | full (e.g. sliding,sliding,full)",
    )
    d.add_argument("--sliding-window", type=int, help="keys a sliding layer's query sees")
    d.add_argument("--is-causal", choices=["true", "false"], help="override causality per layer")
    for flag in ("input-embedding-scale", "output-multiplier", "final-logit-softcapping"):
        d.add_argument(f"--{flag}", type=float)
    d.add_argument(
        "--draft-form",
        choices=["dflash", "dflash2"],
        help="dflash2: a DFlash2DraftModel (dynamic convs and a candidate selector)",
    )
    for flag in ("conv-kernel-size", "conv-group-size", "selector-rank", "selector-top-k"):
        d.add_argument(f"--{flag}", type=int, help="--draft-form dflash2")
    a = p.parse_args(argv)
    if a.is_causal is not None:
        a.is_causal = a.is_causal == "true"
    if a.layer_types is not None:
        a.draft_layers = a.draft_layers or len(a.layer_types)
        if a.sliding_window is None and "sliding_attention" in a.layer_types:
            p.error("--layer-types with sliding layers needs --sliding-window")
    kw = {
        k: v
        for k, v in vars(a).items()
        if v is not None
        and k not in ("out", "preset", "untied", "family", "fused_experts", "multimodal")
    }
    if a.fused_experts:
        kw["fused_experts"] = True
    if a.multimodal:
        kw["multimodal"] = True
    if a.untied:
        kw["tie_word_embeddings"] = False
    if a.preset is None:
        kw.setdefault("head_dim", kw.get("hidden_size", 64) // kw.get("num_heads", 4))
        kw.setdefault("intermediate_size", 2 * kw.get("hidden_size", 64))
    elif a.family:
        kw["family"] = a.family
    try:
        t, d = make_tiny_pair(a.out, family=a.family or "qwen3", preset=a.preset, **kw)
    except ValueError as e:
        raise SystemExit(f"dflash-make-tiny-pair: {e}") from None
    print(f"target: {t}\ndraft:  {d}")


if __name__ == "__main__":
    main()
