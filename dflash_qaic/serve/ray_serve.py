"""dflash-serve as a Ray Serve deployment: the same app, one replica per device group, on as
many hosts as the Ray cluster has.

    from ray import serve
    from dflash_qaic.serve.ray_serve import deployment

    app = deployment("artifacts/qwen3-8b", [[0], [1], [2], [3]], serve_args=["--max-num-seqs", "8"])
    serve.run(app, route_prefix="/")   # OpenAI endpoints on Ray Serve's proxy (port 8000)

Ray has no AI100 accelerator manager, so the SoCs are a custom resource: start each node with
`ray start --resources '{"qaic": 4}'` (its SoCs), and each replica asks for `qaic: k`, k the
devices of one group, so Ray puts at most as many replicas on a node as it has groups. Ray
assigns no ids to a custom resource: a replica takes `device_groups[local_rank]`, its rank among
this deployment's replicas on its node (`serve.get_replica_context().rank.local_rank`, which Ray
keeps in 0 … replicas-on-the-node − 1 and hands a restarted replica back). `serve_args` are
dflash-serve flags, parsed and checked by dflash-serve's own parser (so every option means what
it means there; --host, --port and --device-ids are the deployment's). Each replica's
`/metrics` is its own (Ray's proxy reaches one replica per scrape: scrape replicas directly, or
use Ray's metrics). `ray` is imported only when `deployment` is called (`pip install
'dflash-qaic[ray]'`). docs/DESIGN.md, Replicas.
"""

from __future__ import annotations

_OWN_FLAGS = ("--host", "--port", "--device-ids")


def _check_groups(device_groups) -> int:
    """Every group a non-empty list of distinct ints ≥ 0, all of one size, no device twice."""
    from dflash_qaic.runtime.devices import _ids

    groups = [_ids(g, f"device_groups[{i}]") for i, g in enumerate(device_groups)]
    if not groups:
        raise ValueError("device_groups is empty: give one group per replica on a node, e.g. [[0]]")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"device_groups must all have one size (got {device_groups})")
    seen: set[int] = set()
    for g in groups:
        if seen & set(g):
            raise ValueError(f"device {sorted(seen & set(g))[0]} is in two device_groups")
        seen |= set(g)
    return sizes.pop()


def build_app(artifacts: str, serve_args: list[str], device_ids: list[int]):
    """The dflash-serve app for `artifacts`, these flags and devices (what a replica serves)."""
    from dflash_qaic.serve import cli

    for flag in serve_args:
        if flag.split("=")[0] in _OWN_FLAGS:
            raise ValueError(f"serve_args may not set {flag.split('=')[0]}: the deployment does")
    argv = [str(artifacts), *serve_args, "--device-ids", ",".join(map(str, device_ids))]
    args = cli.parser().parse_args(argv)
    app, _engine, _pipe = cli.build_app(args, cli._check(args))
    return app


def deployment(
    artifacts,
    device_groups: list[list[int]],
    *,
    serve_args: list[str] = (),
    num_replicas: int | None = None,
    name: str = "dflash-serve",
    num_cpus: float = 1.0,
    max_ongoing_requests: int = 256,
):
    """A bound Ray Serve application: `num_replicas` (default: one per group, one node)
    replicas of dflash-serve over `artifacts`, each asking for `qaic: len(group)` and serving
    on `device_groups[local rank on its node]`. For many nodes with the same SoCs, give
    num_replicas = nodes × len(device_groups)."""
    from dflash_qaic.extras import require

    require("ray", "the Ray Serve deployment")
    from ray import serve

    k = _check_groups(device_groups)
    groups = [list(g) for g in device_groups]
    serve_args = list(serve_args)

    @serve.deployment(
        name=name,
        num_replicas=num_replicas or len(groups),
        ray_actor_options={"num_cpus": num_cpus, "resources": {"qaic": k}},
        max_ongoing_requests=max_ongoing_requests,
    )
    @serve.ingress()
    class DFlashServe:
        def __init__(self, artifacts, groups, serve_args):
            rank = serve.get_replica_context().rank.local_rank
            if rank >= len(groups):
                raise RuntimeError(
                    f"replica of local rank {rank}, but only {len(groups)} device groups on "
                    "this node: give the node as many `qaic` resources as its groups' devices"
                )
            self.device_ids = groups[rank]
            self._app = build_app(artifacts, serve_args, self.device_ids)

        def __serve_build_asgi_app__(self):
            return self._app

    return DFlashServe.bind(str(artifacts), groups, serve_args)
