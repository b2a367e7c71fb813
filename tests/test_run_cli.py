"""Incremental text streaming (runtime/streamer.py) and `dflash-run`: --stream prints whole
characters, and bad arguments get one error line, never a traceback."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import dflash_qaic
from dflash_qaic import assets
from dflash_qaic.runtime.cli import _printer, main
from dflash_qaic.runtime.streamer import IncrementalDetokenizer, iter_text
from dflash_qaic.serve.engine import _Text

pytestmark = pytest.mark.draft_every_step  # seeded tokens compared between runs

TEXT = "naïve café costs 3 € — 😀 ok"


@pytest.fixture(scope="module")
def pipe(default_artifacts):
    return dflash_qaic.load(default_artifacts, threads=1)


def chunked(ids, rng):
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i : i + n])
        i += n
    return out


def stream_all(tok, chunks, **kw) -> list[str]:
    s = IncrementalDetokenizer(tok, **kw)
    return [s.push(c) for c in chunks] + [s.flush()]


def test_streamer_never_splits_a_character(pipe):
    tok = pipe.tokenizer  # byte-level: 'é' is two tokens, '€' three, '😀' four
    ids = tok(TEXT)["input_ids"]
    assert len(ids) > len(TEXT)
    rng = random.Random(0)
    for chunks in [[[t] for t in ids], *(chunked(ids, rng) for _ in range(20))]:
        deltas = stream_all(tok, chunks)
        assert "".join(deltas) == TEXT
        assert all("\ufffd" not in d for d in deltas)
    # the old way (each chunk decoded alone) garbles it
    assert "".join(tok.decode([t]) for t in ids) != TEXT


def test_streamer_invalid_bytes_and_special_tokens(pipe):
    tok = pipe.tokenizer
    # a lead byte followed by ASCII is invalid: it comes out as U+FFFD, as decode() says
    assert "".join(stream_all(tok, [[0xC3], [0x41]])) == tok.decode([0xC3, 0x41]) == "\ufffdA"
    # an incomplete character at the very end is released by flush()
    s = IncrementalDetokenizer(tok)
    assert (s.push([0x61, 0xE2, 0x82]), s.push([0x41]), s.flush()) == ("a", "\ufffdA", "")
    s = IncrementalDetokenizer(tok)
    assert (s.push([0x61, 0xE2, 0x82]), s.flush()) == ("a", tok.decode([0xE2, 0x82]))
    eos = pipe.eos[0]
    assert "".join(stream_all(tok, [[0x61], [eos]], skip_special_tokens=True)) == "a"
    assert "".join(stream_all(tok, [[0x61], [eos]])) == tok.decode([0x61, eos])


def test_streamer_with_a_merging_tokenizer():
    """A BPE with merges and a SentencePiece-style word boundary (decode drops the leading
    space of a run): the window keeps the spaces between words."""
    corpus = ["the cat sat on the mat", "a naïve café", "the € sign", "über alles"] * 20
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"])
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    text = "the cat sat on the naïve mat über the € café"
    ids = tok(text)["input_ids"]
    assert any(len(tok.convert_ids_to_tokens(t)) > 2 for t in ids)  # merges happened
    rng = random.Random(1)
    for chunks in [[[t] for t in ids], *(chunked(ids, rng) for _ in range(10))]:
        assert "".join(stream_all(tok, chunks)) == tok.decode(ids)


def test_stop_strings_are_held_back_and_cut(pipe):
    tok = pipe.tokenizer
    ids = tok("abc€END tail")["input_ids"]
    t = _Text(tok, ("€END", "zzzz"), skip_special_tokens=True)
    released, hit = "", False
    for i in ids:
        d, hit = t.push([i])
        released += d
        if hit:
            break
    assert hit and released == "abc"  # nothing of the stop string was ever released
    t = _Text(tok, ("xyz",), skip_special_tokens=True)
    out = [t.push([i]) for i in tok("abcxy")["input_ids"]]
    assert "".join(d for d, _ in out) == "abc" and not any(h for _, h in out)
    assert t.flush() == "xy"  # no stop: the held-back tail comes out at the end


def test_iter_text_joins_to_generate_text(pipe):
    kw = dict(temperature=10.0, seed=3)  # arbitrary bytes, split over steps
    prompt = assets.heldout_prompts()[3]
    res = pipe.generate(prompt, 120, [], **kw)
    deltas = list(iter_text(pipe, prompt, 120, [], **kw))
    assert "".join(deltas) == res.text and all(deltas)


def test_run_stream_prints_whole_characters(default_artifacts, capsys):
    tok = dflash_qaic.load(default_artifacts).tokenizer
    stream, flush = _printer(tok)
    for t in tok("é€")["input_ids"]:
        stream([t])
    flush()
    assert capsys.readouterr().out == "é€"
    args = [str(default_artifacts), "--prompt", assets.heldout_prompts()[3], "--threads", "1"]
    args += [
        "--max-new-tokens",
        "120",
        "--stop-token-ids",
        "",
        "--temperature",
        "10",
        "--seed",
        "3",
    ]
    assert main(args + ["--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert any(ord(c) > 127 and c != "\ufffd" for c in text)  # multibyte characters were made
    assert main(args + ["--stream"]) == 0
    assert capsys.readouterr().out == text + "\n"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", "caf\udce9"], "--prompt is not valid UTF-8 (byte 0xe9 at character 3)"),
        (["--prompt-ids", "1,99999999999999999999"], "does not fit in 64 bits"),
        (["--prompt-ids", "1,x"], "must be comma-separated integers (got 'x')"),
        (["--prompt", "x", "--threads", "0"], "--threads must be in 1 …"),
        (["--prompt", "x", "--threads", "100000"], "--threads must be in 1 …"),
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be ≥ 1 (got 0)"),
        (["--prompt", "x", "--max-new-tokens", "-5"], "--max-new-tokens must be ≥ 1 (got -5)"),
        (["--prompt-ids", "1,-3"], "outside the vocabulary"),
        (["--prompt", "x", "--stop-token-ids", "1,a"], "--stop-token-ids must be"),
    ],
)
def test_run_bad_arguments_one_line(default_artifacts, capsys, extra, message):
    assert main([str(default_artifacts), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("dflash-run: error: ")


def test_run_baseline_warms_both_modes_up_before_timing(default_artifacts, capsys, monkeypatch):
    from dflash_qaic.runtime.pipeline import Pipeline

    calls = []
    for name in ("generate", "generate_baseline"):
        real = getattr(Pipeline, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            calls.append((_name, a[1] if len(a) > 1 else kw.get("max_new_tokens")))
            return _real(self, *a, **kw)

        monkeypatch.setattr(Pipeline, name, spy)
    args = [str(default_artifacts), "--prompt", "def f", "--max-new-tokens", "40", "--threads", "1"]
    assert main(args + ["--baseline", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # a short run of each mode, then the timed runs
    assert calls == [("generate", 32), ("generate_baseline", 32)] + [
        ("generate", 40),
        ("generate_baseline", 40),
    ]
    assert out["baseline"]["tokens"] == out["tokens"] and out["speedup"] > 0
    calls.clear()
    assert main(args) == 0  # no --baseline: no warm-up
    assert calls == [("generate", 40)]


# ---------------------------------------------------------------------- Hugging Face habits


class Recorder:
    """A streamer with HF's interface that records what generate passes."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value)

    def end(self):
        self.ended += 1


def test_generate_takes_hf_streamers(pipe, capsys):
    import numpy as np
    from transformers import TextIteratorStreamer as HFIterator
    from transformers import TextStreamer as HFStreamer

    from dflash_qaic.runtime.streamer import TextIteratorStreamer, TextStreamer

    prompt = assets.heldout_prompts()[3]
    kw = dict(temperature=10.0, seed=3)  # multibyte characters split over steps
    ref = pipe.generate(prompt, 60, [], **kw)
    rec = Recorder()
    res = pipe.generate(prompt, 60, [], streamer=rec, **kw)
    assert res.tokens == ref.tokens and rec.ended == 1
    first, *runs = rec.puts
    ids = pipe.tokenizer(prompt)["input_ids"]
    assert first.shape == (1, len(ids)) and first.tolist() == [ids]  # the prompt first, as HF
    assert all(isinstance(r, np.ndarray) and r.ndim == 1 for r in runs)
    assert [t for r in runs for t in r.tolist()] == ref.tokens
    # ours and transformers' own print / yield the same text
    for cls in (TextStreamer, HFStreamer):
        pipe.generate(prompt, 60, [], streamer=cls(pipe.tokenizer, skip_prompt=True), **kw)
        assert capsys.readouterr().out == ref.text + "\n", cls
    for cls in (TextIteratorStreamer, HFIterator):
        s = cls(pipe.tokenizer, skip_prompt=True, timeout=60)
        pipe.generate(prompt, 60, [], streamer=s, **kw)
        assert "".join(s) == ref.text, cls
    s = TextStreamer(pipe.tokenizer)  # without skip_prompt the prompt is printed too
    pipe.generate(prompt, 8, [], streamer=s, temperature=0)
    assert capsys.readouterr().out.startswith(prompt)
    with pytest.raises(AttributeError, match="IncrementalDetokenizer"):
        s.push([1])


def test_generate_streamer_errors_and_end_on_failure(pipe):
    from dflash_qaic.runtime import GenerationError

    with pytest.raises(GenerationError, match="put"):
        pipe.generate("x", 4, streamer=print)
    with pytest.raises(GenerationError, match="one prompt"):
        pipe.generate(["x", "y"], 4, streamer=Recorder())
    rec = Recorder()

    def boom(_):
        raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        pipe.generate("x", 40, [], streamer=rec, on_tokens=boom, temperature=0)
    assert rec.ended == 1


def test_do_sample_as_transformers(pipe):
    from dflash_qaic.runtime import GenerationError

    prompt = assets.heldout_prompts()[1]
    greedy = pipe.generate(prompt, 24, [], temperature=0).tokens
    assert pipe.generate(prompt, 24, []).tokens == greedy  # default: greedy
    # do_sample=False: greedy whatever the temperature
    assert pipe.generate(prompt, 24, [], do_sample=False, temperature=5.0, seed=1).tokens == greedy
    # do_sample=True: temperature 1.0 unless given
    sampled = pipe.generate(prompt, 24, [], do_sample=True, seed=1)
    assert sampled.tokens == pipe.generate(prompt, 24, [], temperature=1.0, seed=1).tokens
    hot = pipe.generate(prompt, 24, [], do_sample=True, temperature=10.0, seed=1)
    assert hot.tokens == pipe.generate(prompt, 24, [], temperature=10.0, seed=1).tokens
    assert hot.tokens != greedy
    with pytest.raises(GenerationError, match="do_sample=True with temperature=0"):
        pipe.generate(prompt, 4, do_sample=True, temperature=0)
    with pytest.raises(GenerationError, match="do_sample must be"):
        pipe.generate(prompt, 4, do_sample="yes")
    # stream and lists of prompts take it too (one value, or one per prompt)
    assert list(pipe.stream(prompt, 24, [], do_sample=False, temperature=3.0)) == greedy
    res = pipe.generate([prompt, prompt], 24, [], do_sample=[False, True], temperature=10.0, seed=1)
    assert res[0].tokens == greedy and res[1].tokens == hot.tokens


def test_load_a_hub_id_says_to_export_first(tmp_path, monkeypatch):
    from dflash_qaic.runtime import ArtifactsError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArtifactsError) as e:
        dflash_qaic.load("Qwen/Qwen3-4B")
    msg = str(e.value)
    assert "dflash-export --target Qwen/Qwen3-4B --draft " in msg
    assert "--out artifacts/qwen3-4b" in msg and "load('artifacts/qwen3-4b')" in msg
    (tmp_path / "artifacts").mkdir()  # under an existing directory it is a path, mistyped
    with pytest.raises(ArtifactsError, match="does not exist") as e:
        dflash_qaic.load("artifacts/typo")
    assert "Hugging Face" not in str(e.value)


def test_loading_artifacts_imports_no_compiler_module(default_artifacts):
    """The runtime reads the manifest (artifacts/manifest.py) without the compiler module or the
    export orchestration: a fresh interpreter that loads artifacts has neither imported."""
    code = (
        "import sys, dflash_qaic.runtime\n"
        "from dflash_qaic.artifacts.manifest import read_manifest\n"
        f"m = read_manifest({str(default_artifacts)!r})\n"
        f"pipe = dflash_qaic.runtime.load({str(default_artifacts)!r}, tokenizer=False)\n"
        "assert pipe.artifacts == m\n"
        "print([n for n in ('dflash_qaic.compiler.qpc', 'dflash_qaic.artifacts.build', "
        "'dflash_qaic.artifacts.programs') if n in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_check_files_flag_and_its_old_spelling():
    """--check-files fast|full in every command that loads artifacts; --verify, its old name,
    still works and warns, naming the new one."""
    from dflash_qaic.bench.cli import parser as bench_parser
    from dflash_qaic.runtime.cli import parser as run_parser
    from dflash_qaic.serve.cli import parser as serve_parser

    for parser in (run_parser, serve_parser, bench_parser):
        extra = ["--prompt", "x"] if parser is run_parser else []
        assert parser().parse_args(["a", *extra]).check_files == "fast"
        assert parser().parse_args(["a", *extra, "--check-files", "full"]).check_files == "full"
        with pytest.warns(DeprecationWarning, match="--verify is deprecated: use --check-files"):
            args = parser().parse_args(["a", *extra, "--verify", "full"])
        assert args.check_files == "full"
        with pytest.raises(SystemExit):
            parser().parse_args(["a", *extra, "--check-files", "none"])  # Python only
