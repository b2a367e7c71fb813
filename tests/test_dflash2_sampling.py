"""q-aware verification (docs/DESIGN.md, DFlash-2 drafts): the target's sampler with a draft's
q over its candidates keeps the target's distribution (chi-square) and accepts what speculative
sampling accepts, more than the one-hot rule accepts of the same proposals."""

from __future__ import annotations

import numpy as np
import torch
from test_sampling import gof, gof_pvalue

from dflash_qaic.modeling.sampler import sample_next_tokens

V, K, N = 12, 4, 20000  # vocabulary, the draft's candidates, samples (one batch row each)


def _case(seed: int):
    """Target logits for 2 rows, and a draft q over K candidates for the proposal of row 0:
    p's K most likely tokens, flatter than p (a draft sampled at a higher temperature)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, V, generator=gen) * 1.5
    q_ids = logits[0].topk(K).indices
    q_probs = torch.softmax(logits[0, q_ids] * 0.4, 0)
    return logits, q_ids, q_probs


def _run(logits, q_ids, q_probs, aware: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    d = q_ids[torch.multinomial(q_probs, N, replacement=True, generator=gen)]  # [N] from q
    input_ids = torch.stack([torch.zeros(N, dtype=torch.long), d], 1)  # [anchor, d]
    pos = torch.tensor([[5, 6]]).expand(N, 2)
    one = torch.ones(N)
    u = torch.rand(N, 2, 2, generator=gen)
    qi = q_ids.expand(N, 1, K) if aware else d[:, None, None]
    qp = q_probs.expand(N, 1, K) if aware else torch.ones(N, 1, 1)
    out = sample_next_tokens(
        logits.expand(N, 2, V), input_ids, pos, one, torch.zeros(N, dtype=torch.long), one,
        u, V, q_ids=qi, q_probs=qp,
    )  # fmt: skip
    return out[:, 0].numpy(), (out[:, 0] == d).float().mean().item()


def _mixed_rule(logits, q_ids, q_probs, seed):
    """A wrong verifier, the negative control: q-aware acceptance min(1, p(d)/q(d)) with the
    one-hot residual (p with d removed)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(logits[0], 0)
    k = torch.multinomial(q_probs, N, replacement=True, generator=gen)
    d, q_d = q_ids[k], q_probs[k]
    accept = torch.rand(N, generator=gen) * q_d < p[d]
    rest = p.expand(N, V).scatter(1, d[:, None], 0.0)
    other = torch.multinomial(rest, 1, generator=gen)[:, 0]
    return torch.where(accept, d, other).numpy()


def test_q_aware_keeps_the_target_distribution_and_accepts_more():
    """Proposals sampled from q: the q-aware rule returns p and accepts Σ min(p, q). The one-hot
    rule is exact too (for any proposal drawn independently of the target's uniforms) but
    accepts only Σ q·p; a verifier mixing the two (q-aware acceptance, one-hot residual) is
    measurably wrong, which shows the test's power."""
    for seed in range(3):
        logits, q_ids, q_probs = _case(seed)
        p = torch.softmax(logits[0], 0).numpy()
        tokens, acc = _run(logits, q_ids, q_probs, aware=True, seed=seed)
        assert gof_pvalue([gof(tokens, p)]) > 1e-3, seed
        pairs = list(zip(q_ids.tolist(), q_probs.tolist()))
        want = sum(min(p[i], q) for i, q in pairs)  # speculative sampling's acceptance
        assert abs(acc - want) < 4 * (want * (1 - want) / N) ** 0.5 + 1e-3, (acc, want)
        onehot, acc1 = _run(logits, q_ids, q_probs, aware=False, seed=seed)
        assert gof_pvalue([gof(onehot, p)]) > 1e-3, seed
        want1 = sum(p[i] * q for i, q in pairs)
        assert abs(acc1 - want1) < 4 * (want1 * (1 - want1) / N) ** 0.5 + 1e-3, (acc1, want1)
        assert want > want1 + 0.05, (want, want1)
        assert gof_pvalue([gof(_mixed_rule(logits, q_ids, q_probs, seed), p)]) < 1e-6, seed


def test_q_equal_to_p_accepts_everything():
    logits, _, _ = _case(5)
    p = torch.softmax(logits[0], 0)
    q_ids, q_probs = torch.arange(V), p  # the whole vocabulary, q = p
    K_all = V
    gen = torch.Generator().manual_seed(1)
    d = torch.multinomial(p, N, replacement=True, generator=gen)
    one = torch.ones(N)
    out = sample_next_tokens(
        logits.expand(N, 2, V), torch.stack([d * 0, d], 1), torch.tensor([[5, 6]]).expand(N, 2),
        one, torch.zeros(N, dtype=torch.long), one, torch.rand(N, 2, 2, generator=gen), V,
        q_ids=q_ids.expand(N, 1, K_all), q_probs=q_probs.expand(N, 1, K_all),
    )  # fmt: skip
    assert (out[:, 0] == d).float().mean().item() > 0.995


def test_greedy_rows_and_rows_without_proposal():
    """Temperature 0 returns the argmax; the last row (no proposal) samples from p."""
    logits, q_ids, q_probs = _case(7)
    n = 4000
    gen = torch.Generator().manual_seed(2)
    t = torch.tensor([0.0, 1.0]).repeat(n // 2)
    out = sample_next_tokens(
        logits.expand(n, 2, V), torch.tensor([[0, 7]]).expand(n, 2),
        torch.tensor([[5, 6]]).expand(n, 2), t, torch.zeros(n, dtype=torch.long),
        torch.ones(n), torch.rand(n, 2, 2, generator=gen), V,
        q_ids=q_ids.expand(n, 1, K), q_probs=q_probs.expand(n, 1, K),
    )  # fmt: skip
    greedy = logits.argmax(-1)
    assert (out[0::2] == greedy).all()
    p1 = torch.softmax(logits[1], 0).numpy()
    assert gof_pvalue([gof(out[1::2, 1].numpy(), p1)]) > 1e-3
    assert np.unique(out[1::2, 1].numpy()).size > 3


class _Verify(torch.nn.Module):
    def forward(self, logits, ids, pos, temperature, top_k, top_p, u, q_ids, q_probs):
        return sample_next_tokens(
            logits, ids, pos, temperature, top_k, top_p, u, V, q_ids=q_ids, q_probs=q_probs
        )


def test_q_aware_sampler_exports_without_control_flow(tmp_path):
    """Traced to ONNX as the target program traces it (opset 17, no Loop/Scan/If), ONNX Runtime
    returns the tokens torch returns, for 3-row verify calls with 2 q rows."""
    import onnx
    import onnxruntime as ort

    gen = torch.Generator().manual_seed(9)
    n, s = 64, 3
    logits = torch.randn(n, s, V, generator=gen) * 1.5
    ids = torch.randint(0, V, (n, s), generator=gen)
    pos = torch.arange(s).expand(n, s).clone()
    pos[::5, -1] = -1  # some rows padded: no proposal for the row before
    t = torch.rand(n, generator=gen) + 0.3
    t[::4] = 0.0
    top_k, top_p = torch.zeros(n, dtype=torch.long), torch.ones(n)
    u = torch.rand(n, s, 2, generator=gen)
    q_ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(n * 2)]).view(n, 2, K)
    q_ids[:, :, 0] = ids[:, 1:]  # each proposal is among its candidates
    q_probs = torch.softmax(torch.randn(n, 2, K, generator=gen), -1)
    args = (logits, ids, pos, t, top_k, top_p, u, q_ids, q_probs)
    names = ["logits", "ids", "pos", "t", "top_k", "top_p", "u", "q_ids", "q_probs"]
    path = tmp_path / "verify.onnx"
    torch.onnx.export(
        _Verify(), args, str(path), input_names=names, output_names=["next_tokens"],
        opset_version=17, dynamo=False,
    )  # fmt: skip
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert not ops & {"Loop", "Scan", "If"}, ops
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {k: v.numpy() for k, v in zip(names, args)})[0]
    np.testing.assert_array_equal(got, _Verify()(*args).numpy())
