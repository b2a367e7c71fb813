"""The lab beside the product: what builds the project's own fixtures and the built-in pair.

- `dflash_lab.tiny` (`dflash-make-tiny-pair`): random target/draft pairs in the published on-disk
  forms, tiny or at real shapes (presets), for tests and benchmarks;
- `dflash_lab.train`: the trainers of the built-in default pair (`dflash_qaic/assets/pair/CARD.md`);
- `dflash_lab.export_bench` (`dflash-bench --export`): export time and peak memory at real shapes;
- `dflash_lab.serve_bench` (`dflash-bench --serve`): the serving benchmarks.

It needs the `export` extra (torch, transformers). Of the product only `dflash-bench` imports
it, when run: its --export and --serve modes, and --project's reduced exports
(`dflash_qaic/bench/project.py`, the tiny pairs at a published shape).
"""
