"""The Ray Serve deployment (serve/ray_serve.py) on a local Ray cluster of this machine: two
replicas, each taking one `qaic` custom resource and its device group from its local rank,
answering through Ray Serve's proxy on 127.0.0.1 as dflash-serve does. Slow tier (a Ray
cluster takes tens of seconds to start here); ray.shutdown() stops what ray.init started."""

from __future__ import annotations

import pytest

import dflash_qaic
from dflash_qaic.serve.replicas import free_port
from tests.test_serve import decode, scrape

MODEL = "on-ray"


def test_device_groups_are_checked():
    from dflash_qaic.runtime import BackendError
    from dflash_qaic.serve.ray_serve import _check_groups, build_app

    assert _check_groups([[0], [1], [2], [3]]) == 1
    with pytest.raises(ValueError, match="one size"):
        _check_groups([[0], [1, 2]])
    with pytest.raises(ValueError, match="device 1 is in two"):
        _check_groups([[0, 1], [1, 2]])
    with pytest.raises(BackendError, match="≥ 0"):
        _check_groups([[-1]])
    with pytest.raises(ValueError, match="may not set --port"):
        build_app("artifacts", ["--port", "9"], [0])


@pytest.mark.slow
def test_two_replicas_on_a_local_ray_cluster(cb_artifacts):
    import httpx
    import ray
    from ray import serve

    from dflash_qaic.serve.ray_serve import deployment

    pipe = dflash_qaic.load(cb_artifacts, threads=1)
    prompts = ["def fibonacci(n):", "class Stack:\n", "import numpy as np\n", "# sort a list\n"]
    want = [decode(pipe, pipe.generate(p, 16, temperature=0).tokens) for p in prompts]
    port = free_port()
    ray.init(num_cpus=2, resources={"qaic": 2}, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = ["--threads", "1", "--served-model-name", MODEL]
        app = deployment(cb_artifacts, [[3], [5]], serve_args=args, num_cpus=0.5)
        serve.run(app, route_prefix="/", name="dflash")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, trust_env=False) as c:
            assert c.get("/health").status_code == 200
            for p, w in zip(prompts, want):
                body = dict(model=MODEL, prompt=p, max_tokens=16, temperature=0)
                assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == w
            seen = set()
            for _ in range(50):  # the proxy spreads scrapes over both replicas
                seen |= {
                    dict(labels)["target_device_ids"]
                    for (name, labels) in scrape(c)
                    if name == "dflash:device_info"
                }
                if seen == {"3", "5"}:
                    break
            assert seen == {"3", "5"}
    finally:
        serve.shutdown()
        ray.shutdown()
