"""Export-friendly PyTorch modules: target with static KV cache and taps, draft with KV injection."""
