"""What every target family shares: the target's config (`TargetConfig`) and the `Family` a
family module subclasses (docs/DESIGN.md, Seams).

A family answers, from a config.json (a dict: the checkpoint's, or a loaded model's
`config.to_dict()`), every question the rest of the code asks about a target:

    matches(arch, model_type)       is this config one of mine?
    text_config(cfg)                the text model's fields and where its tensors live
    read(directory, cfg)            -> TargetConfig (its own fields: `read_fields`)
    check_supported(text, path)     what the modules refuse (the one place)
    layer_kinds(text)               per layer a `LayerKind` (modeling/target.py builds from it)
    expected_shapes(t, fused)       every tensor the programs read, with its shape
    checkpoint_name(t, param)       the checkpoint tensor of a module parameter (weight sources)
    tiny / tiny_config(spec)        its tiny preset (dflash-make-tiny-pair --family NAME)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dflash_qaic.checkpoint_files.config import (
    CheckpointError,
    check_decoder_supported,
    positive,
    rope_theta,
)

# Token mixers and MLPs a layer may have (modeling/target.py builds one module per kind).
ATTENTION = "attention"  # softmax attention over a KV cache (Qwen3, Llama, Gemma 4, gpt-oss)
GATED_ATTENTION = "gated_attention"  # the same, output-gated, partial RoPE (Qwen3.5)
DELTANET = "deltanet"  # Gated DeltaNet: a recurrent state and a conv window (Qwen3.5)
LATENT_ATTENTION = "latent_attention"  # MLA: a latent + RoPE-key cache (DeepSeek-V3, Kimi K2)
MLP = "mlp"  # silu (or, in a SANDWICH layer, gelu-tanh) gated MLP
MOE = "moe"  # routed experts (modeling/moe.py)
CLAMPED_MOE = "clamped_moe"  # routed experts with biases and the clamped SwiGLU (gpt-oss)
SIGMOID_MOE = "sigmoid_moe"  # sigmoid routing with a correction bias (DeepSeek-V3, MiniMax-M2)
# An attention layer's kind: its window, RoPE table and head shape (docs/DESIGN.md, Layer kinds)
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# How a layer wires its mixer and MLP into the residual stream
PRE_NORM = "pre_norm"  # x += mixer(norm(x)); x += mlp(norm(x))
SANDWICH = "sandwich"  # Gemma 4: norms before and after each, experts beside the MLP, a scalar


@dataclass(frozen=True)
class LayerKind:
    """What a family says one layer is; modeling/target.py builds it from this alone."""

    mixer: str  # ATTENTION, GATED_ATTENTION, DELTANET
    mlp: str  # MLP, MOE, CLAMPED_MOE
    attention: str = FULL_ATTENTION  # an attention mixer's kind (FULL / SLIDING_ATTENTION)
    window: int | None = None  # a sliding kind's window (keys W or more positions back hidden)
    block: str = PRE_NORM  # PRE_NORM or SANDWICH


@dataclass(frozen=True)
class MoeSpec:
    """The experts of a MoE target, from its config.json."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size, of each expert
    norm_topk_prob: bool
    sparse: tuple[bool, ...]  # per layer: experts (True) or the dense MLP (mlp_only_layers)
    shared_intermediate_size: int = 0  # Qwen3.5-MoE's shared expert (0: none)


@dataclass(frozen=True)
class TargetConfig:
    path: Path
    family: str  # the family's name (a key of `families.FAMILIES`)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    raw: dict = field(repr=False, compare=False)
    intermediate_size: int = 0
    moe: MoeSpec | None = None  # a mixture-of-experts target
    # where the text model's tensors live ("model." or, in a published multimodal form,
    # "model.language_model."), and its config (raw, or raw's text_config)
    prefix: str = "model."
    text: dict = field(default=None, repr=False, compare=False)
    deltanet: dict | None = field(default=None, compare=False)  # Gated DeltaNet dims (hybrids)
    spec: Family = field(default=None, repr=False, compare=False)

    @property
    def hybrid(self) -> bool:
        """Gated DeltaNet layers beside full attention (a property of the family)."""
        return self.spec.hybrid


@dataclass(frozen=True)
class TinyFields:
    """The fields of a tiny pair (dflash_lab/tiny.py, TinySpec) only some families have; a
    family module declares its own as a subclass (`Family.tiny_fields`). A dense family has
    none."""

    def streamed(self) -> bool:
        """Whether the pair must be written tensor by tensor (dflash_lab/tiny_writer.py)."""
        return False


@dataclass(frozen=True)
class MoeTiny(TinyFields):
    """A tiny MoE target's experts: num_experts of moe_intermediate_size, top-k routing;
    fused_experts: written as mlp.experts.gate_up_proj / down_proj (the streamed writer)."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    fused_experts: bool = False

    def streamed(self) -> bool:
        return self.fused_experts


class Family:
    """A dense decoder (every layer attention + MLP); family modules override what differs."""

    name: str = ""
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()  # config `model_type` values (the text-only form's too)
    hybrid = False  # Gated DeltaNet layers beside (gated) full attention
    moe = False  # experts in (some) MLPs
    qk_norm = True  # per-head q_norm / k_norm before RoPE
    zero_centred_norms = False  # RMSNorm weights stored as w - 1 (x̂ · (1 + w))
    scaled_embeddings = False  # embeddings multiplied by √H (Gemma 4)
    # weight layout: module parameters Hugging Face holds [E, in, out] in memory while the
    # program reads [E, out, in] (gpt-oss's experts); their placeholders are laid out transposed
    # (exporter/weights.py), so the program's view is free
    transposed_params: tuple[str, ...] = ()
    fields: Mapping = {}  # config fields it reads beyond DECODER_FIELDS (typed before use)
    # its tiny preset: TinySpec fields (dflash_lab/tiny.py, its own `tiny_fields` among them)
    # over the defaults; a tiny pair of this family is `make_tiny_pair(out, family=NAME)`
    tiny: Mapping = {}
    # tiny_fields: the dataclass of the fields of a tiny pair only this family has (below)
    tiny_layout = ""  # how dflash_lab writes its tiny target ("": Hugging Face's save_pretrained)
    ignored_prefixes: tuple[str, ...] = ()  # tensors the checkpoint may carry that no program uses
    own_draft_attention = False  # its drafts' attention shape is their own (not the target's)
    head = "lm_head.weight"  # the untied head's checkpoint tensor (Kimi K2.5's wrapper: its own)
    # Hugging Face builds the model from its text config (a wrapper no causal-LM class loads)
    text_model = False
    tiny_fields = TinyFields

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    def matches(self, arch: str | None, model_type: str | None) -> bool:
        return arch in self.architectures or model_type in self.model_types

    # ------------------------------------------------------------ config

    def text_config(self, cfg: dict, cpath: Path) -> tuple[dict, str]:
        """(the text model's config, the prefix of its tensors)."""
        return cfg, "model."

    def read(self, directory: Path, cfg: dict) -> TargetConfig:
        """The TargetConfig of `cfg` (config.json of `directory`, field types already checked)."""
        cpath = directory / "config.json"
        text, prefix = self.text_config(cfg, cpath)
        heads = positive(text, "num_attention_heads", cpath)
        hidden = positive(text, "hidden_size", cpath)
        tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        n_layers = positive(text, "num_hidden_layers", cpath)
        return TargetConfig(
            path=directory,
            family=self.name,
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=positive(text, "num_key_value_heads", cpath, heads),
            head_dim=positive(text, "head_dim", cpath, hidden // heads or 1),
            vocab_size=positive(text, "vocab_size", cpath),
            rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta(text),
            tie_word_embeddings=bool(tied),
            raw=cfg,
            prefix=prefix,
            text=text,
            spec=self,
            **self.read_fields(text, cpath, n_layers),
        )

    def read_fields(self, text: dict, cpath: Path, n_layers: int) -> dict:
        """The TargetConfig fields only this family has."""
        return {"intermediate_size": positive(text, "intermediate_size", cpath)}

    def check_supported(self, text: Mapping, path: Path) -> None:
        """What the modules refuse, from the text config: silu MLPs, static rope tables, and (a
        dense family) no sliding-window layers. Checkpoint validation and the module build
        both ask here."""
        check_decoder_supported(text, path, "target")
        types = text.get("layer_types") or []
        if any(k != "full_attention" for k in types):
            raise CheckpointError(
                f"{path}: sliding-window layers are not supported "
                f"(layer_types {sorted(set(types))})"
            )

    def layer_kinds(self, text: Mapping) -> list[LayerKind]:
        """What each layer is: its token mixer, its MLP, its attention kind and wiring."""
        return [LayerKind(ATTENTION, MLP)] * int(text["num_hidden_layers"])

    # ------------------------------------------------------------ tensors

    def attention_shapes(self, t: TargetConfig) -> dict[str, list[int]]:
        """A full-attention layer's tensors (names under `{prefix}layers.{i}.`)."""
        H, hd = t.hidden_size, t.head_dim
        q, kv = t.num_heads * hd, t.num_kv_heads * hd
        out = {
            "self_attn.q_proj.weight": [q, H],
            "self_attn.k_proj.weight": [kv, H],
            "self_attn.v_proj.weight": [kv, H],
            "self_attn.o_proj.weight": [H, q],
        }
        if self.qk_norm:
            out |= {"self_attn.q_norm.weight": [hd], "self_attn.k_norm.weight": [hd]}
        if t.raw.get("attention_bias"):
            out |= {f"self_attn.{p}_proj.bias": [n] for p, n in zip("qkvo", (q, kv, kv, H))}
        return out

    def mlp_shapes(self, t: TargetConfig, i: int, fused: bool) -> dict[str, list[int]]:
        """Layer i's MLP tensors and its two norms."""
        H, inter = t.hidden_size, t.intermediate_size
        out = {
            "mlp.gate_proj.weight": [inter, H],
            "mlp.up_proj.weight": [inter, H],
            "mlp.down_proj.weight": [H, inter],
        }
        if t.raw.get("mlp_bias"):
            out |= {"mlp.gate_proj.bias": [inter], "mlp.up_proj.bias": [inter]}
            out |= {"mlp.down_proj.bias": [H]}
        return out | {"input_layernorm.weight": [H], "post_attention_layernorm.weight": [H]}

    def layer_shapes(self, t: TargetConfig, i: int, fused: bool) -> dict[str, list[int]]:
        return self.attention_shapes(t) | self.mlp_shapes(t, i, fused)

    def expected_shapes(self, t: TargetConfig, fused: bool = False) -> dict[str, list[int]]:
        """Every tensor the target programs read, with its shape (Hugging Face names); `fused`:
        a MoE target's experts in the fused form (families/qwen3_moe.py)."""
        H, V, p = t.hidden_size, t.vocab_size, t.prefix
        shapes = {p + "embed_tokens.weight": [V, H], p + "norm.weight": [H]}
        if not t.tie_word_embeddings:
            shapes[self.head] = [V, H]
        for i in range(t.num_layers):
            layer = self.layer_shapes(t, i, fused)
            shapes.update({f"{p}layers.{i}.{k}": s for k, s in layer.items()})
        return shapes

    def ignored_tensors(self, t: TargetConfig, names) -> set[str]:
        """Tensors of this checkpoint (of `names`) no program reads beyond `ignored_prefixes`
        (DeepSeek-V3's multi-token-prediction layer)."""
        return set()

    def weight_parts(self, t: TargetConfig, param: str, tensors: dict):
        """The checkpoint byte ranges (TensorInfo parts, in order) a program weight `param`
        (`layers.…`) is made of when it is not one checkpoint tensor (None: it is; DeepSeek-V3's
        per-head halves of kv_b_proj are rows of one)."""
        return None

    def experts_fused(self, names) -> bool:
        """Whether a checkpoint (its tensor names) stores its experts fused; no experts: False."""
        return False

    def checkpoint_name(self, t: TargetConfig, param: str) -> str:
        """The checkpoint tensor of an export module's layer parameter `layers.…`."""
        return t.prefix + param

    # ------------------------------------------------------------ tiny preset

    def text_model_config(self, text: Mapping) -> dict:
        """A wrapper's text config as a text-only checkpoint's config.json (`text_model`
        families; dequantized: no quantization_config)."""
        return {k: v for k, v in text.items() if k != "quantization_config"}

    def draft_layer_ids(self, target_layers: int) -> list[int] | None:
        """The target layers a real-shape preset's draft reads, when its published drafts fix
        them (None: the default rule, drafts.default_target_layer_ids)."""
        return None

    def tiny_config(self, s):
        """The transformers config of a tiny target of this family (s: dflash_lab's TinySpec)."""
        raise NotImplementedError


def experts_top_k(text: Mapping, cpath: Path, key: str, default_k: int | None = None):
    """(experts, top_k) of a MoE config: `key` experts, `num_experts_per_tok` of them, checked."""
    E = positive(text, key, cpath)
    k = positive(text, "num_experts_per_tok", cpath, default_k)
    if k > E:
        raise CheckpointError(
            f"{cpath}: `num_experts_per_tok` {k} exceeds `{key}` {E} (fix config.json)"
        )
    return E, k


# config field of a tiny target <- its TinySpec field (dflash_lab/tiny.py)
TINY_DIMS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "target_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
}


def decoder_dims(s) -> dict:
    """The shape fields of every tiny target's config (s: a TinySpec)."""
    return {field: getattr(s, name) for field, name in TINY_DIMS.items()}


def decoder_common(s) -> dict:
    """The config fields every tiny dense / MoE target shares (s: a TinySpec)."""
    return dict(
        **decoder_dims(s),
        rms_norm_eps=1e-6,
        tie_word_embeddings=s.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
