"""Reading a Hugging Face checkpoint directory, whatever its model: config.json and the type of
its fields (`config`), safetensors headers and shards (`safetensors`), weight values and digests
(`values`). What a model family reads from these is in dflash_qaic/families/; the target + draft
pair is read and validated by dflash_qaic/checkpoints.py."""
