"""Dense decoders: Qwen3 (per-head q/k RMSNorm before RoPE) and Llama (without). Every layer is
softmax attention over a KV cache and a silu MLP; `Family` is exactly this, so the two only name
themselves and build their tiny config."""

from __future__ import annotations

from dflash_qaic.families.base import Family, decoder_common


class Qwen3(Family):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)

    def tiny_config(self, s):
        from transformers import Qwen3Config

        return Qwen3Config(**decoder_common(s))


class Llama(Family):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)
    qk_norm = False

    def tiny_config(self, s):
        from transformers import LlamaConfig

        return LlamaConfig(**decoder_common(s))


QWEN3 = Qwen3()
LLAMA = Llama()
