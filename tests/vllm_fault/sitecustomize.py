"""Injected into `vllm serve` by tests/test_vllm.py (PYTHONPATH): with $FAULT_PROMPT set, the
plugin's `dflash_qaic.load` returns a pipeline whose target program raises on the prefill of a
prompt beginning with those token ids (tests/faulty_serve.py's Faulty), in the engine-core
process where our worker runs. Every other call runs the real program."""

import os
import sys

if os.environ.get("FAULT_PROMPT"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from faulty_serve import Faulty, prefill_of

    import dflash_qaic

    _load = dflash_qaic.load
    _poison = [int(t) for t in os.environ["FAULT_PROMPT"].split(",")]

    def _faulty_load(*args, **kw):
        pipe = _load(*args, **kw)
        pipe.target = Faulty(pipe.target, prefill_of(_poison))
        return pipe

    dflash_qaic.load = _faulty_load
