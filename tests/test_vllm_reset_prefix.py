"""vLLM's `POST /reset_prefix_cache` under the vLLM plugin (docs/prefix-caching.md, under vLLM):
our engine's cache, resident rows and the host tier, is cleared, so a prompt cached before the
call misses after it, with the same tokens, and is found again once it has run."""

from __future__ import annotations

import httpx
import pytest
from test_vllm_prefix import ARGS, PREFIX, TAILS, complete, counters, delta

from dflash_qaic.bench.vllm_host import VllmServer


@pytest.fixture(scope="module")
def server(cb_artifacts):
    """One `DFLASH_QAIC_VLLM=1 vllm serve`, test_vllm_prefix.py's options, with vLLM's dev
    endpoints (where /reset_prefix_cache is)."""
    with VllmServer(cb_artifacts, *ARGS, timeout=420, env={"VLLM_SERVER_DEV_MODE": "1"}) as s:
        s.model = str(cb_artifacts)
        yield s


def test_reset_prefix_cache_clears_our_cache(server):
    """A hit; the reset; the same prompt misses with the same tokens; then hits again."""
    prompt, other = PREFIX + TAILS[0], PREFIX + TAILS[1]
    want, _ = complete(server, prompt)
    before = counters(server)
    _, cached = complete(server, other)  # the shared prefix hits
    assert cached >= len(PREFIX) and delta(before, counters(server))["hits"] >= len(PREFIX)

    r = httpx.post(server.url + "/reset_prefix_cache", trust_env=False, timeout=60)
    assert r.status_code == 200 and r.json() == {"success": True}, r.text

    before = counters(server)
    got, cached = complete(server, prompt)  # cached before the reset: now a miss
    assert cached == 0 and delta(before, counters(server))["hits"] == 0
    assert got == want
    got, cached = complete(server, other)  # the prompt just run is found again
    assert cached >= len(PREFIX)
