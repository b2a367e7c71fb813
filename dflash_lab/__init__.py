"""The lab beside the product: what builds the project's own fixtures and the built-in pair.

- `dflash_lab.tiny` (`dflash-make-tiny-pair`): random target/draft pairs in the published on-disk
  forms, tiny or at real shapes (presets), for tests and benchmarks;
- `dflash_lab.train`: the trainers of the built-in default pair (`dflash_qaic/assets/pair/CARD.md`);
- `dflash_lab.export_bench` (`dflash-bench --export`): export time and peak memory at real shapes.

It needs the `export` extra (torch, transformers). The product (`dflash_qaic`) never imports it.
"""
