"""Shared fixtures: tiny pairs written and exported once per test run in the real on-disk
formats (once for all xdist workers: the first to ask builds, under a file lock, the others
wait for it and read the same directory)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# One thread per test process, set before torch is imported (subprocesses inherit it): the fast
# tier runs two workers on two cores, and torch's default of a thread per core puts 4 spinning
# OpenMP threads on 2 cores, which made the tiny models' matmuls ~4x slower than one thread
# (the conformance ladder's reference rung: 60 s -> 13 s). ONNX Runtime sessions do not spin
# (runtime/backends.py) and keep their own thread count.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from dflash_lab.tiny import make_tiny_pair  # noqa: E402
from dflash_qaic import families  # noqa: E402

# the cache of checked artifact files (dflash_qaic/artifacts/files.py): one per test run, not the user's
os.environ.setdefault("DFLASH_QAIC_CACHE_DIR", tempfile.mkdtemp(prefix="dflash-qaic-cache-"))


def _key(kw: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in sorted(kw.items())).replace(" ", "")


def shared_dir(tmp_path_factory, kind: str, key: str, build) -> Path:
    """DIR/kind-<hash of key>, made by build(DIR) once for the whole run: xdist workers share
    the parent of their base temporary directories; the first to ask builds under a lock, the
    others wait and reuse it. Nothing may write into it afterwards."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    d = root / "shared" / f"{kind}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"
    d.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(d) + ".lock"):
        if not (d / ".done").exists():
            shutil.rmtree(d, ignore_errors=True)  # a build that failed half way
            d.mkdir()
            build(d)
            (d / ".done").touch()
    return d


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """tiny_pair(family="qwen3", **TinySpec fields) -> (target_dir, draft_dir), cached."""
    cache: dict[str, tuple] = {}

    def make(**kw):
        k = _key(kw)
        if k not in cache:
            d = shared_dir(tmp_path_factory, "pair", k, lambda d: make_tiny_pair(d, **kw))
            cache[k] = (d / "target", d / "draft")
        return cache[k]

    return make


@pytest.fixture
def pair_copy(tiny_pair, tmp_path):
    """A copy of the qwen3 tiny pair (target layers 0 and 3) under tmp_path, for a test to
    damage: (target dir, draft dir)."""
    t, d = tiny_pair(family="qwen3", target_layer_ids=[0, 3])
    shutil.copytree(t, tmp_path / "target")
    shutil.copytree(d, tmp_path / "draft")
    return tmp_path / "target", tmp_path / "draft"


@pytest.fixture(scope="session")
def planned_chunks():
    """planned_chunks(n, lengths) -> the prefill call lengths of an n-token prompt, call by call
    (contract.plan_prefill, as the engine applies it)."""
    from dflash_qaic import contract

    def plan(n: int, lengths: list[int]) -> list[int]:
        out = []
        while n > 0:
            out.append(contract.plan_prefill(n, lengths))
            n -= out[-1]
        return out

    return plan


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """torch.set_num_threads as OMP_NUM_THREADS above says (torch may be imported already)."""
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# ---------------------------------------------------------------- the step policy pinned


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "draft_every_step: this test's (or, as `pytestmark`, this module's) pipelines and "
        "dflash-serve processes draft every step (spec_policy always, not the default auto): "
        "for tests that assert acceptance, accepted counts or draft calls, compare them with "
        "the reference or between runs and servers, or compare seeded tokens across runs",
    )


@contextlib.contextmanager
def _draft_every_step():
    """Pipelines made inside start with spec_policy "always" (a later configure may change
    it), the commands run in this process (dflash-run, -serve, -bench) take "always" as
    --spec-policy's default, and dflash-serve processes started inside get `--spec-policy
    always` unless their flags name a policy."""
    from dflash_qaic.runtime import options
    from dflash_qaic.runtime.pipeline import Pipeline
    from dflash_qaic.serve.process import ServerProcess

    pipe_init, server_init = Pipeline.__init__, ServerProcess.__init__
    flag = dataclasses.replace(options.SPEC_POLICY, default="always")  # the commands' default
    engine_flags = tuple(flag if o is options.SPEC_POLICY else o for o in options.ENGINE_OPTIONS)

    def pinned_pipe(self, *args, **kw):
        pipe_init(self, *args, **kw)
        self.config = dataclasses.replace(self.config, spec_policy="always")

    def pinned_server(self, artifacts, *args, **kw):
        if "--spec-policy" not in args:
            args = (*args, "--spec-policy", "always")
        server_init(self, artifacts, *args, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Pipeline, "__init__", pinned_pipe)
        m.setattr(ServerProcess, "__init__", pinned_server)
        m.setattr(options, "SPEC_POLICY", flag)
        m.setattr(options, "ENGINE_OPTIONS", engine_flags)
        yield


@pytest.fixture(scope="module", autouse=True)
def _module_drafts_every_step(request):
    """A module marked `pytestmark = pytest.mark.draft_every_step`: for its module fixtures
    (servers, pipelines) and its tests."""
    if any(m.name == "draft_every_step" for m in request.node.own_markers):
        with _draft_every_step():
            yield
    else:
        yield


@pytest.fixture(autouse=True)
def _test_drafts_every_step(request):
    """A test marked `@pytest.mark.draft_every_step`: the pipelines and servers it makes."""
    parent = request.node.parent  # a test class's marks too (a module's: the fixture above)
    own = request.node.own_markers + (
        parent.own_markers if isinstance(parent, pytest.Class) else []
    )
    if any(m.name == "draft_every_step" for m in own):
        with _draft_every_step():
            yield
    else:
        yield


@pytest.fixture(scope="session", autouse=True)
def _reference_on_cpu():
    """dflash 0.1.0 times with torch.cuda.synchronize; on a CPU machine use the wall clock."""
    import dflash.model as ref

    ref._cuda_time = time.perf_counter


@pytest.fixture(scope="session")
def default_artifacts(tmp_path_factory):
    """The built-in default pair exported once per run (`dflash-export --out DIR`)."""
    from dflash_qaic.exporter.cli import main

    def build(d):
        assert main(["--out", str(d / "art"), "--no-compile", "--quiet"]) == 0

    return shared_dir(tmp_path_factory, "default-pair", "default", build) / "art"


@pytest.fixture(scope="session")
def cb_artifacts(tmp_path_factory):
    """The built-in default pair exported once per run with --full-batch-size 4 (prefill
    chunk 64, ctx 1024) and --structured-output: the serving tests' continuous-batching
    artifacts (a row without a grammar runs exactly as without the option)."""
    import dflash_qaic
    from dflash_qaic.exporter.cli import load_recipe

    def build(d):
        r = load_recipe("default")
        dflash_qaic.export(
            r["target"],
            r["draft"],
            d / "art",
            full_batch_size=4,
            compile=False,
            prefill_seq_len=64,
            ctx_len=1024,
            structured_output=True,
        )

    return shared_dir(tmp_path_factory, "default-pair-cb", "cb", build) / "art"


# ---------------------------------------------------------------- families, draft forms, exports

#: The model families the tests run over: the families registry's (dflash_qaic/families/), so
#: a family added there is in every test that iterates this: name -> dflash_lab.tiny.TinySpec
#: fields.
FAMILIES: dict[str, dict] = {name: dict(family=name) for name in families.names()}
#: The draft forms: name -> TinySpec fields ("sliding": one sliding and one full layer).
DRAFT_FORMS: dict[str, dict] = {
    "dflash": {},
    "dflash2": dict(draft_form="dflash2"),
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
}
#: The families whose hybrid layers make the reference `dflash_generate` leave HF greedy at
#: near-ties (REFERENCE.md §9): HF greedy is their oracle, the reference only up to there.
REFERENCE_LEAVES_HF = {"qwen3_5", "qwen3_5_moe"}


@dataclass
class Exported:
    """A tiny pair exported once per session: its checkpoints, artifacts and (on demand) the
    target's own Hugging Face model and a pipeline over the artifacts."""

    family: str
    form: str
    target: Path
    draft: Path
    artifacts: Path
    _model: object = field(default=None, repr=False)

    def model(self):
        """The target's own Hugging Face model (fp32, eval), loaded once."""
        if self._model is None:
            from dflash_qaic import checkpoints as ck

            self._model = ck.load_target_model(self.target)
        return self._model

    def load(self, verify_lengths=None, **kw):
        """A new pipeline over the artifacts (dflash_qaic.load keywords); verify_lengths=B for
        whole blocks every step, as the reference verifies."""
        import dflash_qaic

        pipe = dflash_qaic.load(self.artifacts, **kw)
        if verify_lengths is not None:
            pipe.configure(verify_lengths=[verify_lengths])
        return pipe


@pytest.fixture(scope="session")
def exported(tiny_pair, tmp_path_factory):
    """exported(family="qwen3", form="dflash", pair={TinySpec fields}, **ExportOptions fields)
    -> Exported: the tiny pair of that family and draft form written and exported (compile off)
    once per session, cached by all its arguments."""
    from dflash_qaic.artifacts.build import ExportOptions, build_artifacts

    cache: dict[str, Exported] = {}

    def make(family: str = "qwen3", form: str = "dflash", *, pair=None, **options):
        spec = {**FAMILIES[family], **DRAFT_FORMS[form], **(pair or {})}
        opts = ExportOptions(**{"compile": False, **options})  # defaults filled in: one key
        key = _key(spec) + json.dumps(opts.to_json(), sort_keys=True)
        if key not in cache:
            t, d = tiny_pair(**spec)

            def build(out):
                build_artifacts(t, d, out / "art", opts, progress=lambda m: None)

            out = shared_dir(tmp_path_factory, "art", key, build) / "art"
            cache[key] = Exported(family, form, t, d, out)
        return cache[key]

    return make


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """No qaic-compile to be found: not at $QAIC_COMPILER, the SDK's directory or on PATH."""
    from dflash_qaic.compiler import qpc

    monkeypatch.delenv(qpc.COMPILER_ENV, raising=False)
    monkeypatch.setattr(qpc, "SDK_EXEC_DIR", tmp_path / "no-sdk")
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def install_fake_compiler(tmp_path, monkeypatch, mode: str | None = None, log: str = "log"):
    """tests/test_compile.py's stand-in qaic-compile at tmp_path/bin, installed as the compiler
    an export finds (FAKE_QAIC_MODE `mode`, e.g. "hang"), its calls logged to tmp_path/log:
    (the script, the log)."""
    import sys

    from test_compile import FAKE_COMPILER

    from dflash_qaic.compiler import qpc

    script = tmp_path / "bin" / "qaic-compile"
    script.parent.mkdir()
    script.write_text(FAKE_COMPILER.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv(qpc.COMPILER_ENV, str(script))
    monkeypatch.setenv("FAKE_QAIC_LOG", str(tmp_path / log))
    if mode is None:
        monkeypatch.delenv("FAKE_QAIC_MODE", raising=False)
    else:
        monkeypatch.setenv("FAKE_QAIC_MODE", mode)
    return script, tmp_path / log


# ---------------------------------------------------------------- a module's dflash-serve


def serving(artifacts, *args, **kw):
    """A module's `server` fixture: `yield from serving(ARTIFACTS, *dflash-serve flags)`, a real
    dflash-serve process (serve/process.py) for the module, stopped at its end: exit 0."""
    from dflash_qaic.serve.process import ServerProcess

    with ServerProcess(artifacts, *args, **kw) as s:
        yield s
        assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    """An `openai` client of the module's `server` (no retries)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def http(server):
    """An httpx client of the module's `server`."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as c:
        yield c


def stream_lines(url: str, body: dict, each=None, timeout: float = 120) -> tuple[int, list[str]]:
    """`body` streamed from url's /v1/completions on its own connection: (the status, the
    lines); `each(line)` is called as each line arrives."""
    import httpx

    with httpx.Client(timeout=timeout, trust_env=False) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if each is not None:
                    each(line)
            return r.status_code, lines


def leave_mid_stream(http, prompt) -> None:
    """A long streamed completion the client leaves after its second chunk, closing the
    connection mid-stream."""
    body = dict(prompt=prompt, max_tokens=700, ignore_eos=True, temperature=0, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                break  # leaving the block closes the connection mid-stream
    assert seen == 2


# ---------------------------------------------------------------- xdist: what shares a worker

#: the test files that take longest, longest first (per-file totals of a measured `make test`;
#: the ladder's cases are its own units), so that no worker picks one of them up last while the
#: other sits idle; the files not named are each shorter and follow in name order
LONGEST_FIRST = (
    "test_conformance.py",
    "test_sliding.py",
    "test_reliability.py",
    "test_batching.py",
    "test_vllm.py",  # its server starts in its own process: the worker mostly waits
    "test_vllm_prefix.py",
    "test_vllm_sampling.py",
    "test_sampling_families.py",
    "test_prefix_marks.py",
    "test_sampling.py",
    "test_bench.py",
    "test_tree_verify.py",
    "test_hybrid.py",
    "test_fp16.py",
    "test_default_pair.py",
    "test_verify_lengths.py",
    "test_runtime.py",
    "test_streaming_export.py",
    "test_export_cli.py",
    "test_target_export.py",
    "test_integrity.py",
    "test_seeded_batches.py",
    "test_moe_runtime.py",
    "test_train.py",
    "test_serve_batching.py",
    "test_serve.py",
    "test_replicas.py",
)


def _scope(nodeid: str) -> str:
    """A test file runs in one worker (its module and session fixtures, e.g. its servers and
    exports, are built once); the conformance ladder's cases spread over the workers, each
    case's rungs in one."""
    path = nodeid.split("::", 1)[0]
    if path.endswith("test_conformance.py") and nodeid.endswith("]"):
        return path + "[" + nodeid.rsplit("[", 1)[1]
    return path


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (make test) schedules by `_scope`: by file, the ladder by case."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFileLadderByCase(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ByFileLadderByCase(config, log)


def pytest_collection_modifyitems(config, items):
    """The longest files first (a stable sort: the same order in every worker)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))
