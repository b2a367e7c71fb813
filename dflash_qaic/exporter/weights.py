"""Streaming export: trace without the weights in memory, then write them tensor by tensor.

A multi-GB target cannot be exported the plain way on a small host: Hugging Face loads it in
fp32, `torch.onnx.export` keeps a second copy (its tracer holds the parameters it exports) and the reload/re-save a
third. Here instead (docs/DESIGN.md, Artifacts):

1. `placeholder_target` / `placeholder_draft` build the modules with *placeholder* weights:
   views into one private anonymous mapping that is never written, so every page reads as the
   kernel's shared zero page and costs no resident memory. The export modules are built from
   them exactly as from real weights (`ExportTarget.from_hf`, `ExportDraft`).
2. `torch.onnx.export(..., export_params=False)` traces them: the weights become graph inputs
   named by their state-dict names.
3. `write_initializers` turns each weight input into an initializer whose bytes go to the
   external-data file straight from the safetensors files, a slice at a time (bf16/fp16 widened
   to fp32 on the way, checked finite and within fp16's range), applying what the module
   applies to that tensor: the head stored transposed ([H, V]), the draft `fc` divided by its fp16 scale, and the transpose
   the exporter puts on each Linear weight (folded into the written bytes, as constant folding
   does in the in-memory export).

`target_sources` / `draft_sources` map every parameter name of the export modules to its
checkpoint tensor; a parameter they do not know is an error, so a rename cannot go unnoticed.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import queue
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from onnx import TensorProto
from tqdm.auto import tqdm

from dflash_qaic import checkpoints as ck
from dflash_qaic import mxfp4
from dflash_qaic.checkpoint_files import quantized

# External data layout: tensors of ≥ 1 MiB start on a 64 KiB boundary (what onnx's own writer
# does, so ONNX Runtime can map them), smaller ones on 64 bytes.
ALIGN_LARGE, ALIGN_SMALL, LARGE = 1 << 16, 64, 1 << 20
CHUNK_BYTES = 64 << 20  # fp32 bytes converted and written at a time


@dataclass(frozen=True)
class Source:
    """One program weight: checkpoint tensor `info`, divided by `scale`, transposed if asked;
    `fp16`: the value a program holds, checked within fp16's range (else only finite)."""

    info: ck.TensorInfo
    transpose: bool = False
    scale: float = 1.0
    fp16: bool = True


@dataclass(frozen=True)
class Stacked:
    """One program weight made of checkpoint tensors laid end to end, in order: a MoE layer's
    per-expert matrices stacked into the module's [E, 2I, H] / [E, H, I] (modeling/moe.py keeps
    Hugging Face's layout, so no part is transposed)."""

    parts: tuple[ck.TensorInfo, ...]
    shape: tuple[int, ...]
    transpose: bool = False
    scale: float = 1.0
    transpose_parts: bool = False  # each 2-D part transposed (experts stored [E, in, out])

    def __post_init__(self):
        numel = sum(math.prod(p.shape) for p in self.parts)
        if numel != math.prod(self.shape):
            raise ValueError(
                f"{len(self.parts)} tensors of {numel} values cannot fill {self.shape}"
            )

    @property
    def info(self) -> ck.TensorInfo:
        """A stand-in TensorInfo for the whole (its shape and name; bytes are read per part)."""
        a, z = self.parts[0], self.parts[-1]
        nbytes = sum(p.nbytes for p in self.parts)
        return ck.TensorInfo(a.file, f"{a.name} … {z.name}", a.dtype, self.shape, a.offset, nbytes)


def expert_source(tt: dict, name: str, shape: tuple[int, ...]) -> Source | Stacked:
    """The checkpoint tensors of a MoE block's `…mlp.gate_up` [E, 2I, H] or `…mlp.down`
    [E, H, I] (`name` with the `model.` prefix): the fused tensor when the checkpoint has one,
    else expert e's gate_proj and up_proj (or down_proj) for e = 0 … E-1."""
    prefix, kind = name.rsplit(".", 1)
    fused = tt.get(f"{prefix}.experts.{kind}_proj")
    if fused is not None:
        return Source(fused)
    projs = ("gate_proj", "up_proj") if kind == "gate_up" else ("down_proj",)
    keys = [f"{prefix}.experts.{e}.{p}.weight" for e in range(shape[0]) for p in projs]
    missing = [k for k in keys if k not in tt]
    if missing:
        raise KeyError(f"target program parameter `{name}` misses checkpoint tensor {missing[0]}")
    return Stacked(tuple(tt[k] for k in keys), tuple(shape))


@dataclass(frozen=True)
class Mxfp4:
    """One program weight stored as MXFP4 (gpt-oss experts): a `…_blocks` / `…_scales` pair,
    dequantized exactly a row block at a time (dflash_qaic/mxfp4.py) into `shape`, the
    checkpoint's [E, rows, cols] layout (no transpose)."""

    blocks: ck.TensorInfo
    scales: ck.TensorInfo
    shape: tuple[int, ...]
    transpose: bool = False
    scale: float = 1.0
    fp16: bool = True

    def __post_init__(self):
        rows, groups = mxfp4.check_pair(self.blocks, self.scales)
        if rows * groups * mxfp4.BLOCK != math.prod(self.shape):
            raise ck.CheckpointError(
                f"MXFP4 tensors `{self.blocks.name}` {list(self.blocks.shape)} do not hold the "
                f"program's {list(self.shape)}; the checkpoint does not match its config.json"
            )

    @property
    def info(self) -> ck.TensorInfo:
        """A stand-in TensorInfo of the dequantized fp32 whole (its name and shape)."""
        b, n = self.blocks, 4 * math.prod(self.shape)
        name = b.name.removesuffix("_blocks")
        return ck.TensorInfo(b.file, name, "F32", self.shape, b.offset, n)


def expert_slices(info: ck.TensorInfo) -> tuple[ck.TensorInfo, ...]:
    """A 3-D checkpoint tensor [E, a, b] as E 2-D tensors [a, b] (byte ranges of one file)."""
    E = info.shape[0]
    per = info.nbytes // E
    return tuple(
        ck.TensorInfo(info.file, f"{info.name}[{e}]", info.dtype, tuple(info.shape[1:]),
                      info.offset + e * per, per)
        for e in range(E)
    )  # fmt: skip


def stored_source(info: ck.TensorInfo, name: str, shape: tuple, inverted: bool) -> Source | Stacked:
    """The source of program weight `name` of `shape` from checkpoint tensor `info`: as stored,
    or (`inverted`: the family stores it [E, in, out], Hugging Face's in-memory layout, as
    gpt-oss's dequantized form does) a stack of its experts, each transposed on the way into the
    program's [E, out, in]."""
    if not inverted:
        if len(info.shape) != len(shape) and math.prod(info.shape) == math.prod(shape):
            return Stacked((info,), tuple(shape))  # the module holds it reshaped (gpt-oss sinks)
        return Source(info)
    have = tuple(info.shape)
    if len(shape) != 3 or have != (shape[0], shape[2], shape[1]):
        raise ck.CheckpointError(
            f"checkpoint tensor `{info.name}` has shape {list(have)}; the program's `{name}` "
            f"{list(shape)} needs it as [{shape[0]}, {shape[2]}, {shape[1]}]"
        )
    return Stacked(expert_slices(info), tuple(shape), transpose_parts=True)


def source_chunks(src: Source | Stacked | Mxfp4, transpose: bool):
    """`fp32_chunks` of a Source, or of each part of a Stacked one in order (each transposed
    when the Stacked one says so), or an MXFP4 pair's dequantized row blocks."""
    if isinstance(src, Mxfp4):
        for block in mxfp4.mxfp4_chunks(src.blocks, src.scales):
            _check_block(block, src)
            yield block
    elif isinstance(src, Stacked):
        for part in src.parts:
            yield from fp32_chunks(Source(part, scale=src.scale), src.transpose_parts)
    else:
        yield from fp32_chunks(src, transpose)


# ---------------------------------------------------------------- placeholder modules


# Every placeholder's first element: 1, 2, 3, … across all arenas, exact in fp32 (below 2^24).
_MARKS = itertools.count(1)


class _ZeroArena:
    """fp32 tensors backed by one private anonymous mapping that is never written: reads map
    the shared zero page, so a multi-GB placeholder model costs (almost) no RSS."""

    def __init__(self, numel: int):
        self._mm = mmap.mmap(-1, max(4 * numel, 4), flags=mmap.MAP_PRIVATE)
        self._all = torch.frombuffer(self._mm, dtype=torch.float32)
        self._next = 0

    def take(self, shape) -> torch.Tensor:
        """A placeholder of `shape`: zeros but for a first element no other placeholder has, so
        the exporter's pass that merges equal initializers leaves each weight its own graph
        input (one page per tensor becomes resident). The mark is a small integer, exact in
        fp32: a mark derived from the offset (offset · 1e-12) rounded two small neighbours of a
        multi-GB model to one value, and the exporter merged them (a Qwen3.5 layer's dt_bias
        became its A_log)."""
        n = math.prod(shape)
        t = self._all[self._next : self._next + n]
        self._next += -(-n // 16) * 16  # 64-byte aligned starts
        mark = next(_MARKS)
        if mark >= 1 << 24:
            raise RuntimeError("more than 2^24 placeholder weights: their marks are not exact")
        t[0] = float(mark)
        return t.view(*shape)


def _materialize(module: torch.nn.Module, transposed: set[str] = frozenset()) -> None:
    """Replace every (meta) parameter by a zero placeholder, keeping tied parameters tied.
    Names in `transposed` ([out, in] weights, or [E, in, out] experts) become views of storage
    with the last two axes swapped, so the export module's transpose of them copies nothing."""
    unique = dict(module.named_parameters())  # tied parameters appear once, by either name
    flip = {id(p) for n, p in module.named_parameters(remove_duplicate=False) if n in transposed}
    arena = _ZeroArena(sum(-(-p.numel() // 16) * 16 for p in unique.values()))
    new: dict[int, torch.nn.Parameter] = {}
    for p in unique.values():
        if id(p) in flip:  # [..., a, b] held as a view of [..., b, a] storage
            *lead, a, b = p.shape
            data = arena.take((*lead, b, a)).transpose(-1, -2)
        else:
            data = arena.take(tuple(p.shape))
        new[id(p)] = torch.nn.Parameter(data, requires_grad=False)
    for m in module.modules():
        for k, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[k] = new[id(p)]
    module._dflash_arena = arena  # keep the mapping alive with the module


def _marked_zeros(shape, dtype) -> torch.Tensor:
    """Zeros of `dtype` but for a mark no other placeholder has (never merged, as `_ZeroArena`'s).
    In a narrow float (a bf16 checkpoint's buffer: MiniMax-M2's e_score_correction_bias) a large
    count is not exact and two marks can round to one value, so the mark is written as base-128
    digits over the first elements (each exact in bf16 and fp16), as many as the tensor holds."""
    z = torch.zeros(shape, dtype=dtype)
    flat, mark = z.view(-1), next(_MARKS)
    if not flat.numel():
        return z
    if dtype in (torch.float32, torch.float64) or not dtype.is_floating_point or flat.numel() == 1:
        flat[0] = mark
        return z
    for i in range(min(flat.numel(), 4)):
        flat[i] = (mark >> (7 * i)) & 127
    return z


def placeholder_target(t: ck.TargetConfig) -> torch.nn.Module:
    """The Hugging Face model of `t` with zero placeholder weights (no RSS) and real rotary
    tables: what `ExportTarget.from_hf` needs to build the export module."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(t.path, local_files_only=True)
    cfg = cfg.get_text_config() if t.spec.text_model else cfg  # a wrapper: its text model
    cfg._attn_implementation = "eager"
    cfg.get_text_config()._attn_implementation = "eager"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    text = getattr(model.model, "language_model", model.model)  # a multimodal form's text model
    text.rotary_emb = type(text.rotary_emb)(config=text.config)
    for m in text.modules():  # checkpoint buffers (Gemma 4's layer_scalar): placeholders too
        for k, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[k] = _marked_zeros(b.shape, b.dtype)
    flip = t.spec.transposed_params  # gpt-oss's [E, in, out] experts
    names = {n for n, _ in model.named_parameters() if flip and n.endswith(flip)}
    _materialize(model, transposed={"lm_head.weight"} | names)
    return model.eval()


def placeholder_draft(c: ck.DraftConfig):
    """`DFlashDraft` of `c` with zero placeholder weights and its real rotary tables."""
    from dflash_qaic.modeling.draft import DFlashDraft, Rope

    with torch.device("meta"):
        draft = DFlashDraft(c)
    _materialize(draft)
    draft.rope = Rope.from_config(c.raw)
    return draft.eval()


def placeholder_head(t: ck.TargetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed [V, H], head [V, H]) placeholders for the draft program: one tensor when tied;
    the head a transposed view, so the module's [H, V] copy of it copies nothing."""
    arena = _ZeroArena(2 * t.vocab_size * t.hidden_size)
    head = arena.take((t.hidden_size, t.vocab_size)).t()
    embed = head if t.tie_word_embeddings else arena.take((t.vocab_size, t.hidden_size))
    head._dflash_arena = arena  # noqa: SLF001 (keeps the mapping alive)
    return embed, head


class _MatMulLinear(torch.nn.Module):
    """nn.Linear with its weight held transposed, [in, out]: traced as MatMul(x, weight) with
    no Transpose, the exact graph constant folding makes of F.linear in the in-memory export.
    The parameter keeps its name (`weight`); the writer stores the checkpoint tensor transposed.
    `weight_t` is a contiguous placeholder (the exporter copies non-contiguous parameters)."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.nn.Parameter | None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight_t, requires_grad=False)  # [in, out]
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return y + self.bias if self.bias is not None else y


def stream_ready(module: torch.nn.Module) -> torch.nn.Module:
    """Swap every nn.Linear of an export module (whose weights are placeholders) for a
    `_MatMulLinear` with a fresh [in, out] placeholder (in place; returns the module)."""
    linears = [
        (parent, name, child)
        for parent in list(module.modules())
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    # weights a module derives from a checkpoint tensor (`derived_params`: MLA's W_UK / W_UV,
    # views of one placeholder) get placeholders of their own, so none is merged with another
    derived = [(m, n) for m in module.modules() for n in getattr(m, "derived_params", ())]
    sizes = [c.weight.numel() for _, _, c in linears] + [getattr(m, n).numel() for m, n in derived]
    arena = _ZeroArena(sum(-(-n // 16) * 16 for n in sizes))
    for parent, name, child in linears:
        w = arena.take((child.in_features, child.out_features))
        setattr(parent, name, _MatMulLinear(w, child.bias))
    for m, n in derived:
        setattr(m, n, torch.nn.Parameter(arena.take(tuple(getattr(m, n).shape)), False))
    module._dflash_linear_arena = arena
    return module


def _transposed_names(module: torch.nn.Module) -> set[str]:
    return {
        f"{prefix}.weight" for prefix, m in module.named_modules() if isinstance(m, _MatMulLinear)
    }


# ---------------------------------------------------------------- name mapping


def _head_sources(pair: ck.Pair, tied: bool) -> dict[str, Source]:
    tt, p = pair.target_tensors, pair.target.prefix  # "model." (or a multimodal text model's)
    head = tt[p + "embed_tokens.weight"] if tied else tt[pair.target.spec.head]
    out = {"head_t": Source(head, transpose=True)}
    if not tied:
        out["embed"] = Source(tt[p + "embed_tokens.weight"])
    return out


def target_sources(module: torch.nn.Module, pair: ck.Pair) -> dict[str, Source]:
    """Every parameter of an `ExportTarget` -> its checkpoint tensor and transform."""
    t, tt, dt, p = pair.target, pair.target_tensors, pair.draft_tensors, pair.target.prefix
    fixed = {
        "norm.weight": Source(tt[p + "norm.weight"]),
        "fc.weight": Source(dt["fc.weight"], scale=float(module.fc_scale)),
        "hidden_norm.weight": Source(dt["hidden_norm.weight"]),
        **_head_sources(pair, module.tied),
    }
    flip = t.spec.transposed_params  # stored [E, in, out] (gpt-oss, bf16 form)
    out = {}
    for name, param in module.named_parameters():
        cname = t.spec.checkpoint_name(t, name) if name.startswith("layers.") else None
        if name in fixed:
            out[name] = fixed[name]
        elif cname in tt:
            inverted = bool(flip) and cname.endswith(flip)
            out[name] = stored_source(tt[cname], name, tuple(param.shape), inverted)
        elif f"{cname}_blocks" in tt and f"{cname}_scales" in tt:  # MXFP4 (gpt-oss experts)
            out[name] = Mxfp4(tt[f"{cname}_blocks"], tt[f"{cname}_scales"], tuple(param.shape))
        elif name.startswith("layers.") and (parts := t.spec.weight_parts(t, name, tt)):
            out[name] = Stacked(parts, tuple(param.shape))  # rows of a checkpoint tensor
        elif name.startswith("layers.") and name.endswith((".mlp.gate_up", ".mlp.down")):
            out[name] = expert_source(tt, t.spec.checkpoint_name(t, name), tuple(param.shape))
        else:
            raise KeyError(f"target program parameter `{name}` has no checkpoint tensor")
    return _with_transposes(module, out)


def _with_transposes(module: torch.nn.Module, out: dict[str, Source]) -> dict[str, Source]:
    for name in _transposed_names(module):
        s = out[name]
        out[name] = Source(s.info, transpose=not s.transpose, scale=s.scale)
    return out


def draft_sources(module: torch.nn.Module, pair: ck.Pair) -> dict[str, Source]:
    """Every parameter of an `ExportDraft` -> its checkpoint tensor (the draft's own, or the
    target's embedding / head) and transform."""
    dt = pair.draft_tensors
    fixed = {"norm.weight": Source(dt["norm.weight"])}
    if getattr(module, "own_head", False):  # a reduced vocabulary: the draft's head (drafts.py)
        tt, p = pair.target_tensors, pair.target.prefix
        fixed["head_t"] = Source(dt["lm_head.weight"], transpose=True)
        fixed["embed"] = Source(tt[p + "embed_tokens.weight"])
    else:
        fixed.update(_head_sources(pair, module.tied))
    out = {}
    for name, _ in module.named_parameters():
        if name in fixed:
            out[name] = fixed[name]
        elif name.startswith(("layers.", "candidate_selector.")) and name in dt:
            out[name] = Source(dt[name])
        else:
            raise KeyError(f"draft program parameter `{name}` has no checkpoint tensor")
    return _with_transposes(module, out)


# ---------------------------------------------------------------- streaming the bytes


def _read(info: ck.TensorInfo, start: int, nbytes: int) -> torch.Tensor:
    """`nbytes` of tensor `info` from byte `start` of its data, as a flat tensor of its dtype."""
    buf = bytearray(nbytes)
    with open(info.file, "rb") as f:
        f.seek(info.offset + start)
        got = f.readinto(buf)
    if got != nbytes:
        raise ck.CheckpointError(
            f"{info.file}: tensor `{info.name}` is cut short ({got} of {nbytes} bytes read); "
            "the file changed or is truncated; download it again"
        )
    return (
        torch.frombuffer(buf, dtype=ck.SAFETENSORS_DTYPES[info.dtype]) if nbytes else torch.empty(0)
    )


def _check_block(x: torch.Tensor, src: Source) -> None:
    """A guard for a file changed since `checkpoints.check_weight_values` read it: inf / NaN
    anywhere shows in the min or max (NaN propagates), and the value the program holds (divided
    by the source's scale) must fit fp16. One cheap pass."""
    if not x.numel():
        return
    lo, hi = (v.item() for v in torch.aminmax(x))
    peak = max(-lo, hi)
    limit = ck.FP16_MAX if src.fp16 else math.inf
    if not (math.isfinite(lo) and math.isfinite(hi)) or peak / src.scale > limit:
        raise ck.beyond_fp16(src.info, peak if math.isfinite(lo + hi) else math.nan)


def _fp32(x: torch.Tensor, src: Source) -> torch.Tensor:
    """fp32 (exact from bf16 / fp16), divided by the source's scale as `fp16_safe_fc_weight`
    divides the module's weight."""
    x = x.float()
    return x / src.scale if src.scale > 1.0 else x


def fp32_chunks(src: Source, transpose: bool):
    """The fp32 program tensor of `src` (transposed when `transpose`) as row blocks, in order,
    checked finite; at most the source tensor (in its own dtype, twice when transposed) and one
    fp32 block in memory. A quantized source is dequantized a block at a time (its codes, one
    byte an element, held whole when transposed)."""
    info = src.info
    if isinstance(info, ck.QuantizedTensor):  # FP8 / INT4 (checkpoint_files/quantized.py)
        for x in quantized.chunks(info, transpose and len(info.shape) == 2, CHUNK_BYTES):
            _check_block(x, src)
            yield _fp32(x, src)
        return
    shape = info.shape if info.shape else (1,)
    isz = ck.SAFETENSORS_DTYPES[info.dtype].itemsize
    if not transpose or len(shape) == 1:
        rows = shape[0]
        row = info.nbytes // max(rows, 1)
        step = max(1, CHUNK_BYTES // max(4 * (row // isz), 1))
        for r0 in range(0, rows, step):
            x = _read(info, r0 * row, min(step, rows - r0) * row)
            _check_block(x, src)
            yield _fp32(x, src)
        return
    R, C = shape
    t = torch.empty(C, R, dtype=ck.SAFETENSORS_DTYPES[info.dtype])  # [C, R], source dtype
    row = info.nbytes // R
    step = max(1, CHUNK_BYTES // (2 * row))
    for r0 in range(0, R, step):
        x = _read(info, r0 * row, min(step, R - r0) * row).view(-1, C)
        _check_block(x, src)
        t[:, r0 : r0 + x.shape[0]] = x.t()
    step = max(1, CHUNK_BYTES // (4 * R))
    for c0 in range(0, C, step):
        yield _fp32(t[c0 : c0 + step], src)


def _is_transpose_2d(node: onnx.NodeProto) -> bool:
    if node.op_type != "Transpose":
        return False
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
    return perm == [1, 0]


def _plan(graph: onnx.GraphProto, sources: dict[str, Source]):
    """[(initializer name, source, transposed?)] for every weight input, folding the Transpose
    nodes that consume a weight; removes those inputs and nodes from `graph`."""
    users: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for x in node.input:
            users[x].append(node)
    merged = sorted(set(sources) - {i.name for i in graph.input})
    if merged:  # the exporter took two placeholders for one weight: the program would be wrong
        raise RuntimeError(
            f"streaming export: weights {merged[:5]} are not graph inputs of their own (the "
            "exporter merged them with an equal placeholder); this is a bug in "
            "exporter/weights.py, please report it"
        )
    plan, dropped, rename = [], set(), {}
    for inp in graph.input:
        if inp.name not in sources:
            continue
        src = sources[inp.name]
        nodes = users[inp.name]
        if any(not _is_transpose_2d(n) for n in nodes):
            plan.append((inp.name, src, src.transpose))
        folded = [n for n in nodes if _is_transpose_2d(n)]
        for n in folded:
            dropped.add(id(n))
            rename[n.output[0]] = folded[0].output[0]
        if folded:
            plan.append((folded[0].output[0], src, not src.transpose))
    keep = [n for n in graph.node if id(n) not in dropped]
    for node in keep:
        for i, x in enumerate(node.input):
            node.input[i] = rename.get(x, x)
    del graph.node[:]
    graph.node.extend(keep)
    weights = [i for i in graph.input if i.name in sources]
    for w in weights:
        graph.input.remove(w)
    return plan


def _tensor_proto(name: str, src: Source, transpose: bool) -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT)
    dims = list(src.info.shape)
    t.dims.extend(list(reversed(dims)) if transpose else dims)
    return t


def attach_initializers(
    model: onnx.ModelProto,
    sources: dict[str, Source],
    data_path: Path | None,
    *,
    desc: str = "writing weights",
) -> int:
    """Turn the weight inputs of `model` into initializers, streaming their bytes from the
    checkpoints: into `data_path` (external data, aligned offsets) or inline when it is None.
    Returns the bytes of weights written."""
    plan = _plan(model.graph, sources)
    total = sum(4 * math.prod(s.info.shape or (1,)) for _, s, _ in plan)
    quiet = os.environ.get("TQDM_DISABLE", "") not in ("", "0")  # dflash-export --quiet
    bar = tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        leave=False,
        mininterval=1.0,
        disable=quiet,
    )
    f = open(data_path, "wb") if data_path is not None else None
    blocks = _prefetch(plan)
    try:
        for i, group in itertools.groupby(blocks, key=lambda item: item[0]):
            name, src, transpose = plan[i]
            t = _tensor_proto(name, src, transpose)
            n = 4 * math.prod(t.dims)
            if f is None:
                t.raw_data = b"".join(c.numpy().tobytes() for _, c in group)
            else:
                align = ALIGN_LARGE if n >= LARGE else ALIGN_SMALL
                offset = -(-f.tell() // align) * align
                f.write(b"\0" * (offset - f.tell()))
                for _, c in group:
                    f.write(memoryview(c.numpy()).cast("B"))
                t.data_location = TensorProto.EXTERNAL
                for k, v in (("location", data_path.name), ("offset", offset), ("length", n)):
                    e = t.external_data.add()
                    e.key, e.value = k, str(v)
            model.graph.initializer.append(t)
            bar.update(n)
    finally:
        blocks.close()  # stops the prefetch thread on any error
        bar.close()
        if f is not None:
            f.close()
    return total


def _prefetch(plan):
    """(entry index, fp32 block) for every block of every plan entry, in order, read and
    converted by a background thread while the caller writes the previous block (file I/O and
    torch ops release the GIL). At most two blocks wait in the queue."""
    q: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce():
        try:
            for i, (_, src, transpose) in enumerate(plan):
                for block in source_chunks(src, transpose):
                    if not put((i, block)):
                        return
            put(None)
        except BaseException as e:  # re-raised in the caller's thread
            put(e)

    worker = threading.Thread(target=produce, name="weights-prefetch", daemon=True)
    worker.start()
    try:
        while (item := q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        worker.join()


def weights_bytes(sources: dict[str, Source]) -> int:
    return sum(4 * math.prod(s.info.shape or (1,)) for s in sources.values())


# In-RAM graph runs (the fp16 check loads the whole program, converts it, and runs it in ONNX
# Runtime: ≈ 6× its size). Above this many bytes of weights they are skipped, and the facts say
# so; the structural checks (checker, ops, I/O, shapes) always run.
GRAPH_RUN_MAX_BYTES = int(os.environ.get("DFLASH_GRAPH_RUN_MAX_BYTES", 512 << 20))
# A streamed program keeps its weights inline only below this (else one external-data file).
STREAM_INLINE_MAX = 64 << 20


def graph_run_skip_reason(nbytes: int) -> str | None:
    if nbytes <= GRAPH_RUN_MAX_BYTES:
        return None
    return (
        f"fp16 run skipped: the program holds {nbytes / 1e9:.2f} GB of weights and an in-RAM "
        f"run needs about 6x that; runs are limited to {GRAPH_RUN_MAX_BYTES / 1e9:.2f} GB "
        "(set DFLASH_GRAPH_RUN_MAX_BYTES to raise it). Structural checks ran"
    )


def load_fp32(info: ck.TensorInfo) -> torch.Tensor:
    """One checkpoint tensor in fp32 (checked finite): for the few small tensors the export
    modules need real values of (the draft's fc, for its fp16 scale, and hidden_norm)."""
    return torch.cat(list(fp32_chunks(Source(info, fp16=False), False))).view(info.shape)


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the main graph's initializers (from their dims, so external data need not be loaded)."""
    total = 0
    for t in model.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        total += n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total
