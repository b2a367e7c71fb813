"""`dflash-bench`: the benchmark and its report.

- `stats`: pure statistics (τ, acceptance histograms, medians and spread, the speedup bound,
  the host traffic model);
- `run`: measurement (prompts, alternating target-only / DFlash runs in one process, the PyTorch
  peers, memory bandwidth, the cost profile of real shapes);
- `report`: results.json, report.md and report.png;
- `cli`: the `dflash-bench` command (`main(argv=None)`).
"""
