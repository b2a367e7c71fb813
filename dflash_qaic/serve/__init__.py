"""`dflash-serve`: an OpenAI-compatible HTTP server over the DFlash runtime (vLLM's endpoints,
fields, streaming and speculative-decoding metric names).

- `protocol`: the wire format (strict pydantic request models, error and response bodies);
- `engine`: the worker thread that owns the Pipeline, and the request queue;
- `metrics`: Prometheus metrics with vLLM's names;
- `app`: the FastAPI routes; `cli`: the `dflash-serve` command (`main(argv=None)`).

Importing this package needs the `serve` extra (fastapi, uvicorn, prometheus_client).
"""
