"""What the card computes: a program under its compile profile's numerics, on the host.

`qaic-compile -convert-to-fp16 -mxfp6-matmul` with an MXINT8 KV cache (custom_io.yaml) changes
three things about an exported fp32 program, and `CardProgram` reproduces each one:

- **MatMul weights in MXFP6.** Every initializer a MatMul (or Gemm) reads as its weight is
  stored as MX blocks of 32 along the reduction axis (K of x·W: axis -2 of the second input,
  axis -1 of a first input or of Gemm's transB input), E8M0 scales, E2M3 elements
  (`exporter/mx.py`). The rounding is done in a *copy* of the graph (`card_model`): the
  exported file is never touched. An initializer that another op also reads (the tied
  embedding `head_t`, which a Gather reads) is rounded for the MatMul only: the MatMul reads a
  rounded copy and the Gather the original, as a store that compresses MatMul weights would.
- **fp16 everywhere else**, as `-convert-to-fp16`: the graph is converted and evaluated the way
  the fp16-faithful check does it (`exporter/fp16_check.py`: onnx's reference evaluator, whose
  numpy kernels compute fp16 in fp16; ONNX Runtime's CPU provider cannot, docs/precision.md).
- **K/V in MXINT8 as they are written to the cache.** The `past_key.*`/`past_value.*` a call
  returns (`*_RetainedState`) are rounded to MXINT8 in blocks of 32 along head_dim before the
  next call reads them. Within one call the rows it has just written are read as the call
  computed them (fp16): the MXINT8 store sits at the retained-state boundary, where the custom
  IO precision applies. Each slot is its own set of blocks and MX rounding is idempotent on
  MX values, so rounding the whole returned cache equals rounding the written rows. Recurrent
  state (`past_state.*`, `past_conv.*`) stays fp16, as the compile step keeps it.

`CardNumerics.from_profile` reads which of these a compile profile asks for. A profile that
compiles without `-convert-to-fp16` (the AI200 bf16 profile) is refused: this evaluation models
fp16 compute only.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from dflash_qaic import contract, state
from dflash_qaic.exporter import fp16_check, mx


class CardNumericsError(ValueError):
    """A profile or program this evaluation cannot model; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class CardNumerics:
    """The formats a compile profile gives a program: MatMul weights (an MX format name or None
    for fp16) and KV cache (an MX format name or None for fp16)."""

    weights: str | None = "mxfp6"
    kv: str | None = "mxint8"
    profile: str = "ai100_mxfp6_mxint8"

    @classmethod
    def from_profile(cls, profile) -> CardNumerics:
        """From a `compiler.profiles.CompileProfile` (duck-typed: mxfp6_matmul, kv_dtype,
        convert_to_fp16, hw_version, name)."""
        if not profile.convert_to_fp16 or profile.kv_dtype == "bfloat16":
            raise CardNumericsError(
                f"profile {profile.name} compiles in bfloat16 ({profile.hw_version}, "
                f"convert_to_fp16: {profile.convert_to_fp16}, kv_dtype: {profile.kv_dtype}); "
                "the card-numerics evaluation models fp16 compute only: give an fp16 profile "
                "(e.g. ai100_mxfp6_mxint8)"
            )
        return cls(
            weights="mxfp6" if profile.mxfp6_matmul else None,
            kv="mxint8" if profile.kv_dtype == "mxint8" else None,
            profile=profile.name,
        )

    def describe(self) -> str:
        w = "MatMul weights fp16"
        if self.weights:
            w = f"MatMul weights MX{mx.mx_format(self.weights).name.upper()} (block 32, E8M0)"
        kv = "KV MXINT8" if self.kv else "KV fp16"
        return f"profile {self.profile}: {w}, {kv}, fp16 elsewhere"


# ---------------------------------------------------------------- the weights


def matmul_weights(graph: onnx.GraphProto) -> dict[tuple[int, int], int]:
    """(node index, input index) -> reduction axis, for every MatMul/Gemm input that is an
    initializer (the weights -mxfp6-matmul stores)."""
    inits = {t.name for t in graph.initializer}
    out = {}
    for n, node in enumerate(graph.node):
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        trans = {a.name: a.i for a in node.attribute}
        for i, name in enumerate(node.input[:2]):
            if name not in inits:
                continue
            if node.op_type == "Gemm":
                t = trans.get("transA" if i == 0 else "transB", 0)
                axis = -1 if (i == 0) != bool(t) else -2
            else:
                axis = -1 if i == 0 else -2
            out[(n, i)] = axis
    return out


def round_matmul_weights(model: onnx.ModelProto, fmt: str) -> dict[str, int]:
    """Round, in place, every MatMul/Gemm weight initializer of `model` (loaded with its data)
    to MX `fmt` along its reduction axis. An initializer something else reads too gets a
    rounded copy (`<name>__<fmt>`) for the MatMuls. Returns {initializer: elements rounded}."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, int] = {}
    for node in g.node:
        for x in node.input:
            readers[x] = readers.get(x, 0) + 1
    sites = matmul_weights(g)
    by_name: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for (n, i), axis in sites.items():
        by_name.setdefault((g.node[n].input[i], axis), []).append((n, i))
    done = {}
    for (name, axis), uses in by_name.items():
        arr = numpy_helper.to_array(inits[name])
        rounded = numpy_helper.from_array(mx.mx_round(arr, fmt, axis=axis), name)
        if readers[name] == len(uses) and sum(k[0] == name for k in by_name) == 1:
            inits[name].CopyFrom(rounded)
        else:
            rounded.name = f"{name}__{fmt}_axis{axis % arr.ndim}"
            g.initializer.append(rounded)
            for n, i in uses:
                g.node[n].input[i] = rounded.name
        done[name] = arr.size
    return done


def card_model(model: onnx.ModelProto, numerics: CardNumerics) -> onnx.ModelProto:
    """A copy of `model` (loaded with its external data) with the profile's weight rounding."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    if numerics.weights:
        round_matmul_weights(m, numerics.weights)
    return m


# ---------------------------------------------------------------- the program


def quantized_buffers(records: list[dict]) -> set[str]:
    """The retained buffers a profile's MX KV format applies to, from a program's state specs
    (the manifest's `state` record, state.py): attention caches, not a recurrent state."""
    return {b["name"] for r in records if state.KINDS[r["kind"]].quantizable for b in r["buffers"]}


def round_kv(name: str, value: np.ndarray, fmt: str | None, quantized: set[str]) -> np.ndarray:
    """A retained cache as the card stores it: K/V in MX `fmt` along head_dim (the last axis),
    anything its state spec keeps in fp16 (recurrent state) unchanged."""
    if fmt is None or name not in quantized:
        return value
    return mx.mx_round(value, fmt, axis=-1)


class CardProgram(fp16_check.FaithfulProgram):
    """The runtime's Program interface over a program under card numerics: MX weights (in a copy
    of the graph), fp16 compute, caches stored in the KV format between calls. Arguments as
    `FaithfulProgram`, plus the `CardNumerics`."""

    def __init__(
        self,
        onnx_path: str | os.PathLike,
        inputs: list[dict],
        outputs,
        symbols: dict,
        numerics: CardNumerics,
        quantized: set[str],
    ):
        super().__init__(onnx_path, inputs, outputs, symbols)
        self.numerics, self.quantized = numerics, quantized
        # the fp16 form of the card's copy (the parent's session, on the exported graph as it
        # is, is replaced: the file on disk is never rewritten)
        model = card_model(onnx.load(str(onnx_path)), numerics)
        self.session = fp16_check.FaithfulSession(model, os.path.basename(onnx_path))

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = super().run(feeds)
        for name in self.kv:  # the caches as the card stores them for the next call
            self.kv[name] = round_kv(name, self.kv[name], self.numerics.kv, self.quantized)
        return out


def _state_records(manifest: Mapping, role: str) -> list[dict]:
    if "state" not in manifest[role]:
        raise ValueError(
            f"the {role} program's manifest record has no state specs (an export older than "
            "them): re-export the artifacts to evaluate them under card numerics"
        )
    return manifest[role]["state"]


def card_programs(
    artifacts: str | os.PathLike, manifest: Mapping, numerics: CardNumerics
) -> dict[str, CardProgram]:
    """The target and draft programs of an export under `numerics` (manifest: its JSON form)."""
    symbols = {contract.BATCH: int(manifest["batch_size"]), contract.CTX: int(manifest["ctx_len"])}
    if manifest.get("full_batch_size"):
        symbols[contract.FULL_BATCH] = int(manifest["full_batch_size"])
    return {
        p: CardProgram(
            os.path.join(artifacts, manifest[p]["onnx"]),
            manifest[p]["inputs"],
            manifest[p]["outputs"],
            symbols,
            numerics,
            quantized_buffers(_state_records(manifest, p)),
        )
        for p in contract.ROLE_NAMES
    }
