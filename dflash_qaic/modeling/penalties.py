"""The target's logits before its choice: the extended sampling adjustments and the masks
(docs/DESIGN.md, Extended sampling). Traced into the target graph; every function works on
[b, s, V] logits.

Row j of a call decides the token after its input token; the history of that decision is the
request's generated tokens before the call (the host's summary: counts per token, the prompt's
tokens as a bitmask, the last few generated ids) plus the call's own inputs up to row j that are
generated tokens (a verify's anchor and proposals d1 … dj, a decode's anchor; none of a prompt
chunk's). So every verify row is adjusted exactly as the target alone would adjust it after
those tokens, and the lossless rules then act on the adjusted distribution. Order as vLLM's:
logit bias, then the penalties (repetition, frequency, presence), then the masks (grammar, bad
words, min_tokens: applied last, so no penalty can lift a masked token back), min_p in the
sampler after the temperature.

The draft (`proposal_logits`) applies the additive adjustments and the masks before it
proposes, so its proposals follow the adjusted target; it proposes its block in one pass, so its
history is the summary and the anchor alone (the proposals before a row are not known to it yet).
"""

from __future__ import annotations

import torch

from dflash_qaic import contract as c
from dflash_qaic.modeling.sampler import mask_logits, token_allowed


def choice_logits(logits, x: dict, vocab: int, bitmask: bool, extended: bool) -> tuple:
    """(the logits the choice is made from [b, s, V], the acceptance's keywords: the mask's
    floor, min_p). Without either option: the logits as they are and no keywords."""
    kw, allowed = {}, None
    if extended:
        logits, banned = adjust_logits(logits, x, vocab)
        allowed = ~banned
        kw["min_p"] = x[c.MIN_P]
    if bitmask:  # structured output: only the grammar's tokens can be chosen
        bits = token_allowed(x[c.TOKEN_BITMASK], vocab)
        allowed = bits if allowed is None else allowed & bits
    if allowed is not None:
        logits, kw["floor"] = mask_logits(logits, allowed)
    return logits, kw


def proposal_logits(logits, x: dict, block_ids, block_pos, vocab: int) -> torch.Tensor:
    """The draft's logits [b, B − 1, V] (row j proposes position start + j + 1) adjusted as
    the target's verify row j will be, from the history summary and the anchor: the block's
    rows after the anchor are not tokens yet (NO_TOKEN: counted nowhere, matching no bad
    word). Banned tokens sink to the floor (`mask_logits`), so no argmax takes one. The
    additive adjustments only: bias, frequency and presence move a token's logit by the same
    amount in the draft as in the target, so they carry over; the repetition penalty scales a
    logit by where it sits (l / r or l · r), and the draft's logits sit elsewhere than the
    target's (measured in docs/sampling.md: it gains nothing on a DFlash draft and costs a
    DFlash-2 selector, whose unary scores it rescales against the pairwise ones)."""
    ids = torch.cat([block_ids[:, :1], block_ids[:, 1:-1] * 0 + c.NO_TOKEN], dim=1)  # [b, B−1]
    x = {**x, c.INPUT_IDS: ids, c.POSITION_IDS: block_pos[:, :-1]}  # the target's row layout
    logits, banned = adjust_logits(logits, x, vocab, repetition=False)
    return mask_logits(logits, ~banned)[0]


def adjust_logits(
    logits, x: dict, vocab: int, repetition: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits after logit bias and the penalties [b, s, V], the tokens bad words and
    min_tokens rule out [b, s, V] bool); repetition False: without the repetition penalty."""
    ids, pos = x[c.INPUT_IDS], x[c.POSITION_IDS]  # [b, s]
    v = torch.arange(vocab, device=logits.device)
    generated = (pos >= x[c.GENERATED_FROM][:, None]) & (pos >= 0)  # [b, s]
    hit = (ids[..., None] == v) & generated[..., None]  # [b, s, V]
    counts = x[c.OUTPUT_COUNTS][:, None, :] + hit.to(logits.dtype).cumsum(1)  # [b, s, V]
    bias = (logits[:, 0, :] * 0).scatter_add(1, x[c.LOGIT_BIAS_IDS], x[c.LOGIT_BIAS])  # [b, V]
    logits = logits + bias[:, None, :]
    out_seen = counts > 0
    if repetition:
        seen = out_seen | token_allowed(x[c.PROMPT_TOKENS][:, None, :], vocab)  # [b, s, V]
        r = x[c.REPETITION_PENALTY][:, None, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - x[c.FREQUENCY_PENALTY][:, None, None] * counts
    logits = logits - x[c.PRESENCE_PENALTY][:, None, None] * out_seen.to(logits.dtype)
    return logits, min_tokens_bans(pos, x, v) | bad_word_bans(ids, pos, generated, x, v)


def min_tokens_bans(pos, x: dict, v) -> torch.Tensor:
    """[b, s, V]: the stop tokens at rows deciding a position before STOP_ALLOWED_FROM."""
    stop = (x[c.MIN_TOKENS_STOP_IDS][..., None] == v).to(torch.int32).sum(1) > 0  # [b, V]
    early = (pos + 1 < x[c.STOP_ALLOWED_FROM][:, None]) & (pos >= 0)  # [b, s]
    return stop[:, None, :] & early[..., None]


def bad_word_bans(ids, pos, generated, x: dict, v) -> torch.Tensor:
    """[b, s, V]: at row j, the last token of every bad word whose other tokens are the
    generated tokens just before row j's decision (the output tail, then the call's generated
    inputs up to row j); a one-token word everywhere (vLLM's rule)."""
    L = c.BAD_WORD_TOKENS
    words = x[c.BAD_WORDS]  # [b, W, L], right-aligned, -1 before a word
    inputs = torch.where(generated, ids, c.NO_TOKEN)  # a prompt token matches no word
    tokens = torch.cat([x[c.OUTPUT_TAIL], inputs], dim=1)  # [b, L − 1 + s]
    rows = (ids[0] * 0 + 1).cumsum(0) - 1  # [s]: 0 … s−1 (shape-inferable, see sampler)
    # row j's L − 1 tokens before its decision: tokens j + 1 … j + L − 1
    window = torch.stack([tokens.index_select(1, rows + 1 + k) for k in range(L - 1)], -1)
    prefix = words[:, None, :, : L - 1]  # [b, 1, W, L − 1]
    ok = (prefix == -1) | (prefix == window[:, :, None, :])  # [b, s, W, L − 1]
    last = words[..., L - 1]  # [b, W]
    match = (ok.to(torch.int32).amin(-1) == 1) & (last >= 0)[:, None, :]  # [b, s, W]
    banned = (ids[..., None] * 0) != 0  # [b, s, 1] all False
    for w in range(words.shape[1]):
        banned = banned | (match[..., w : w + 1] & (last[:, None, w : w + 1] == v))
    return banned
