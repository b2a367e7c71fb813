"""Trace a module to ONNX with the TorchScript exporter, named and shaped by contract specs.

`export_onnx` is shared by the target and draft exporters: graph input/output names and dynamic
axes come from `TensorSpec`s, so no I/O name is spelled here. Writes are atomic: the model is
exported into a temporary directory beside the destination and renamed into place, the `.onnx`
last, so an interrupted export never leaves a file at `path`.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import onnx
import torch

from dflash_qaic import contract
from dflash_qaic.contract import TensorSpec
from dflash_qaic.exporter.weights import initializer_bytes

# Above this many bytes of weights the model goes to external data (protobuf caps at 2 GB).
EXTERNAL_DATA_THRESHOLD = int(1.5 * 1024**3)
# onnxruntime 1.31 reads IR <= 13; onnx 1.23 stamps 14 on models it builds.
MAX_IR_VERSION = 10


def data_file_name(path: str | os.PathLike) -> str:
    """Name of the external-data file of an .onnx file: `<name>.data`, beside it."""
    return Path(path).name + ".data"


def _dynamic_axes(specs: list[TensorSpec]) -> dict[str, dict[int, str]]:
    return {
        s.name: {i: d for i, d in enumerate(s.shape) if isinstance(d, str)}
        for s in specs
        if any(isinstance(d, str) for d in s.shape)
    }


def export_onnx(
    module: torch.nn.Module,
    example_inputs: tuple,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    path: str | os.PathLike,
    *,
    opset: int = 17,
    external_data: bool | None = None,
    sources: dict | None = None,
) -> Path:
    """Export `module(*example_inputs)` to `path`; returns `path`.

    external_data: True writes all weights to one `<name>.data` file beside the .onnx; None
    does so only when the weights exceed EXTERNAL_DATA_THRESHOLD.
    sources: parameter name -> `weights.Source`: the streaming export. The module's weights are
    placeholders, traced as graph inputs and written from the checkpoints tensor by tensor
    (see exporter/weights.py); None: the module's own weights are exported (in memory).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        raw = tmp_dir / "raw" / path.name
        raw.parent.mkdir()
        _trace(module, example_inputs, inputs, outputs, raw, opset, streamed=sources is not None)
        final, data_name = tmp_dir / path.name, data_file_name(path)
        if sources is None:
            external = _write_in_memory(raw, final, data_name, inputs, outputs, external_data)
        else:
            external = _write_streamed(
                raw, final, data_name, inputs, outputs, external_data, sources
            )
        # Commit: data file first, .onnx last (its appearance marks a complete export).
        stale_data = path.parent / data_name
        if external:
            os.replace(tmp_dir / data_name, stale_data)
        os.replace(final, path)
        if not external and stale_data.exists():
            stale_data.unlink()
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return path


def _finish_graph(model: onnx.ModelProto, inputs, outputs) -> None:
    """IR version readable by onnxruntime; graph I/O dims exactly as the contract says."""
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    _stamp_io_shapes(model.graph, inputs, outputs)


def _write_in_memory(raw: Path, final: Path, data_name: str, inputs, outputs, external) -> bool:
    """The traced model with its own weights, rewritten at `final` (weights in `data_name`
    beside it when external, or above EXTERNAL_DATA_THRESHOLD when None). Returns external."""
    # Reload (pulling in any per-tensor external files the exporter wrote for > 2 GB) and
    # write the final form: one data file at most.
    model = onnx.load(str(raw))
    _finish_graph(model, inputs, outputs)
    if external is None:
        external = initializer_bytes(model) > EXTERNAL_DATA_THRESHOLD
    if external:
        onnx.save_model(
            model,
            str(final),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data_name,
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, str(final))
    return external


def _write_streamed(raw: Path, final: Path, data_name, inputs, outputs, external, sources) -> bool:
    """The traced graph (weights as inputs) with its initializers written from the checkpoints
    tensor by tensor (exporter/weights.py). Returns whether they went to external data."""
    from dflash_qaic.exporter import weights

    model = onnx.load(str(raw))  # the graph alone: no weights in it
    _check_weight_inputs(model.graph, inputs, sources)
    shutil.rmtree(raw.parent)
    if external is None:
        external = weights.weights_bytes(sources) > weights.STREAM_INLINE_MAX
    data = final.parent / data_name if external else None
    weights.attach_initializers(model, sources, data, desc=f"writing {final.name}")
    _finish_graph(model, inputs, outputs)
    onnx.save_model(model, str(final))
    return external


def _trace(module, example_inputs, inputs, outputs, raw: Path, opset: int, streamed: bool):
    # the module binds its arguments and orders its results by these names (modeling/), so
    # the graph's names and the tensors they carry come from one list
    module.input_names = [s.name for s in inputs]
    module.output_names = [s.name for s in outputs]
    with torch.no_grad(), _quiet(), _layer_progress(module, raw.name):
        torch.onnx.export(
            module.eval(),
            tuple(example_inputs),
            str(raw),
            input_names=[s.name for s in inputs],
            output_names=[s.name for s in outputs],
            dynamic_axes=_dynamic_axes(inputs + outputs),
            opset_version=opset,
            do_constant_folding=True,
            export_params=not streamed,
            dynamo=False,
        )


@contextlib.contextmanager
def _layer_progress(module: torch.nn.Module, name: str):
    """A progress bar over the decoder layers while the exporter traces the module."""
    from tqdm.auto import tqdm

    layers = getattr(module, "layers", None) or []
    quiet = os.environ.get("TQDM_DISABLE", "") not in ("", "0")  # dflash-export --quiet
    bar = tqdm(total=len(layers), desc=f"tracing {name}", unit="layer", leave=False, disable=quiet)

    def tick(*_):  # a forward hook must return None (anything else replaces the output)
        bar.update(1)

    hooks = [m.register_forward_hook(tick) for m in layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        bar.close()


def _check_weight_inputs(graph, inputs, sources) -> None:
    """Every graph input is a contract input or a weight with a source: a weight the exporter
    folded into an anonymous input (e.g. a transposed copy) would have no bytes to write."""
    names = {s.name for s in inputs}
    stray = [i.name for i in graph.input if i.name not in names and i.name not in sources]
    if stray:
        raise RuntimeError(
            f"streaming export: graph inputs {stray[:5]} are neither contract inputs nor "
            "weights with a checkpoint source (the module uses a weight through an op the "
            "exporter constant-folds; see exporter/weights.py)"
        )


def _stamp_io_shapes(graph: onnx.GraphProto, inputs, outputs) -> None:
    """Graph input/output dims exactly as the contract says: symbols by name, static sizes as
    values (the tracer names dims it cannot prove static, e.g. an ArgMax output's)."""
    for values, specs in ((graph.input, inputs), (graph.output, outputs)):
        by_name = {s.name: s for s in specs}
        for v in values:
            spec = by_name.get(v.name)
            if spec is None:
                continue
            dims = v.type.tensor_type.shape.dim
            del dims[:]
            for d in spec.shape:
                dim = dims.add()
                if isinstance(d, str):
                    dim.dim_param = d
                else:
                    dim.dim_value = d


@contextlib.contextmanager
def _quiet():
    """Silence the TorchScript exporter's tracer/deprecation warnings and its stdout chatter."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


def program_facts(path: Path, io, specializations: list[dict], report: dict) -> dict:
    """What the manifest records of any exported program: files, I/O specs, specializations,
    dimensions (from the contract's io object) and the graph-check report."""
    data = path.parent / data_file_name(path)
    sym = specializations[0]["symbols"]
    return {
        "path": str(path),
        "external_data": str(data) if data.exists() else None,
        "inputs": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in io.inputs],
        "outputs": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in io.outputs],
        "specializations": specializations,
        "batch_size": sym[contract.BATCH],
        "ctx_len": sym[contract.CTX],
        "emit_logits": io.emit_logits,
        "continuous_batching": io.continuous_batching,
        "comp_ctx": io.comp_ctx,
        **({"confidence": io.confidence} if isinstance(io, contract.DraftIO) else {}),
        **(_hybrid_facts(io) if getattr(io, "hybrid", False) else {}),
        **({"ring_slots": list(io.ring_slots)} if getattr(io, "ring_slots", ()) else {}),
        **({"layer_kv": list(io.layer_kv)} if getattr(io, "layer_kv", ()) else {}),
        **({"latent_dims": list(io.latent_dims)} if getattr(io, "latent_dims", ()) else {}),
        **({"q_top_k": io.q_top_k} if getattr(io, "q_top_k", 0) else {}),  # DFlash-2 draft's q
        **({"top_k": io.top_k} if getattr(io, "top_k", 0) else {}),  # --draft-top-k
        **({"pair_k": io.pair_k} if getattr(io, "pair_k", 0) else {}),  # … of a DFlash-2 draft
        **({"draft_q": list(io.draft_q)} if getattr(io, "draft_q", ()) else {}),
        **({"token_bitmask": True} if getattr(io, "token_bitmask", False) else {}),
        **(_logprob_facts(io) if getattr(io, "logprobs", 0) else {}),
        **({"extended_sampling": True} if getattr(io, "extended_sampling", False) else {}),
        **(
            {"verify_rule": io.verify_rule}
            if getattr(io, "verify_rule", contract.CHAIN) != contract.CHAIN
            else {}
        ),
        "n_layers": io.n_layers,
        "n_kv_heads": io.n_kv_heads,
        "head_dim": io.head_dim,
        "hidden_size": io.hidden_size,
        "vocab_size": io.vocab_size,
        "onnx_bytes": path.stat().st_size + (data.stat().st_size if data.exists() else 0),
        "check": report,
    }


def _logprob_facts(io) -> dict:
    """A target exported with --logprobs: K and the mode (absent otherwise)."""
    return {"logprobs": io.logprobs, "logprobs_mode": io.logprobs_mode}


def export_and_check(
    module: torch.nn.Module,
    io,
    specializations: list[dict],
    feeds_for,
    out_path: str | os.PathLike,
    *,
    check_specs: list[dict],
    trace_rows: int,
    external_data: bool | None,
    sources: dict | None,
    fp16_check: bool | str,
) -> tuple[Path, dict]:
    """Trace `module` at `trace_rows` rows of the first specialization, write the program (its
    weights streamed from `sources` when given, see exporter/weights.py) and run the graph check.
    feeds_for(specs) -> one input feed per specialization (the exporter's `check_feeds`);
    check_specs: the specializations the fp16 run feeds (the plan's longest shapes,
    `ShapePlan.longest`: a smaller window, a shorter verify or prefill computes the same
    values on fewer slots or rows).
    The fp16 run is skipped above `weights.GRAPH_RUN_MAX_BYTES` of streamed weights, and the
    report says why. Returns (path, graph-check report)."""
    from dflash_qaic.exporter import weights
    from dflash_qaic.exporter.graph_check import check_graph

    sym = specializations[0]["symbols"]
    trace = {contract.BATCH: sym[contract.BATCH], contract.SEQ: trace_rows}
    trace[contract.CTX] = sym[contract.CTX]
    if contract.FULL_BATCH in sym:  # continuous batching: trace 2 rows, so batch stays symbolic
        trace[contract.BATCH] = 2
        trace[contract.FULL_BATCH] = max(sym[contract.FULL_BATCH], 2)
    if contract.CCL in sym:
        trace[contract.CCL] = sym[contract.CCL]
    first = specializations[0]
    example = feeds_for([{"name": first["name"], "kind": first["kind"], "symbols": trace}])[0]
    example_inputs = tuple(torch.from_numpy(example[s.name]) for s in io.inputs)
    path = export_onnx(
        module,
        example_inputs,
        io.inputs,
        io.outputs,
        out_path,
        external_data=external_data,
        sources=sources,
    )
    skipped = weights.graph_run_skip_reason(weights.weights_bytes(sources)) if sources else None
    feeds = feeds_for(check_specs) if fp16_check and not skipped else None
    dtype = fp16_check if isinstance(fp16_check, str) else "float16"  # a bf16 profile's
    report = check_graph(path, io, specializations, feeds, dtype=dtype)
    if fp16_check and skipped:
        report["skipped"] = skipped
    return path, report


def _hybrid_facts(io) -> dict:
    """A hybrid target's Gated DeltaNet layers and state dims (contract.TargetIO)."""
    return {"linear_layers": list(io.linear_layers), "state_dims": list(io.state_dims)}
