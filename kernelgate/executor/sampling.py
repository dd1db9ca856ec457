"""Next-token sampling: greedy, temperature, top-k, top-p, with a per-request seed; and the
log-probabilities of what was sampled.

Each request owns its generator, so the tokens it draws do not depend on which other
requests share the batch. temperature <= 0 is greedy (argmax).

Logprobs (`SamplingParams.logprobs = k`) are those of the model's raw distribution,
log_softmax(logits) in fp32, before temperature, top-k and top-p: what vLLM reports by
default (its "raw_logprobs" mode). So they do not depend on the sampling settings, and a
sampled token that top-k / top-p would never have dropped has the same logprob as under
greedy decoding. Each sampled token gets its own logprob and the k most likely tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] fp32 -> temperature-scaled logits with tokens outside top-k / top-p at -inf."""
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def sample_async(logits: torch.Tensor, params: list, generators: list) -> torch.Tensor:
    """logits [N, V] fp32, one row per request -> N token ids on the logits' device, without
    waiting for it; -1 for a row with a non-finite logit (NaN / inf: the caller ends that request
    with an error, never token 0). A sampled row draws from its own generator exactly once per
    call (one uniform number), finite or not, so a request's draws never depend on the other rows.

    The sampled rows are filtered and drawn together (`filter_logits`' rules, row by row, in a
    few batched ops): per row a kernel sequence would be ~10 launches, 640 a step at 64 streams."""
    out = ops.greedy_tokens(logits)          # each row's first maximum, -1 where a logit is not finite
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    finite = out >= 0
    dev, V = logits.device, logits.shape[-1]
    idx = torch.tensor(rows, device=dev)
    ps = [params[i] for i in rows]
    x = logits.index_select(0, idx)
    x = torch.where(finite.index_select(0, idx)[:, None], x, torch.zeros_like(x))   # a valid draw either way
    x = x / torch.tensor([p.temperature for p in ps], device=dev)[:, None]
    ks = [p.top_k if 0 < p.top_k < V else 0 for p in ps]
    tops = [p.top_p for p in ps]
    order = None
    if any(ks) or min(tops) < 1.0:
        x, order = torch.sort(x, dim=-1, descending=True)
        if any(ks):   # below the k-th largest: out (ties with it stay, as in filter_logits)
            k = torch.tensor([k or V for k in ks], device=dev)
            x = x.masked_fill(x < x.gather(1, (k - 1)[:, None]), float("-inf"))
        if min(tops) < 1.0:   # a token whose better-ranked ones already reach top_p: out (the first stays)
            probs = torch.softmax(x, dim=-1)
            top_p = torch.tensor(tops, device=dev)[:, None]
            x = x.masked_fill(((torch.cumsum(probs, dim=-1) - probs) >= top_p) & (top_p < 1.0), float("-inf"))
    cdf = torch.cumsum(torch.softmax(x, dim=-1), dim=-1)
    u = torch.cat([torch.rand(1, generator=generators[i], device=dev) for i in rows])
    total = cdf[:, -1:]
    # (below the cdf's top, so the draw lands on a token that has probability, never past the end)
    pos = torch.searchsorted(cdf, torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total))),
                             right=True)
    tok = pos[:, 0] if order is None else order.gather(1, pos)[:, 0]
    out = out.index_copy(0, idx, tok)
    return torch.where(finite, out, -1)


def sample(logits: torch.Tensor, params: list, generators: list) -> list[int]:
    """`sample_async`, read back: one host sync."""
    return sample_async(logits, params, generators).tolist()


@dataclass
class TokenLogprobs:
    """One sampled token's entry: its logprob and the `k` most likely tokens, best first."""
    logprob: float
    top: list                        # [(token_id, logprob)], len k


def logprobs_async(logits: torch.Tensor, tokens: torch.Tensor, params: list):
    """logits [N, V] fp32 (the rows `sample_async` saw) and the tokens it drew, on the device ->
    a handle for `read_logprobs` (None where no request asked for logprobs): the drawn token's
    logprob and the top-k of the raw distribution per asking row, still on the device."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return None
    dev = logits.device
    sel = torch.tensor(want, device=dev)
    lp = torch.log_softmax(logits.index_select(0, sel), dim=-1)                            # [W, V]
    chosen = lp.gather(1, tokens.index_select(0, sel).clamp(min=0)[:, None])             # [W, 1]
    k = min(max(params[i].logprobs for i in want), lp.shape[-1])
    top = lp.topk(k, dim=-1)                                                                # [W, k]
    # ids travel as fp32, exact below 2**24 (vocabularies are far smaller)
    return want, k, torch.cat([chosen, top.values, top.indices.float()], dim=1)           # [W, 1 + 2k]


def read_logprobs(handle, tokens: list[int], params: list) -> list:
    """`logprobs_async`'s handle, read back (one host copy) -> per row a TokenLogprobs, or None
    where the request asked for none (or its row was not finite: tokens[i] < 0)."""
    out: list = [None] * len(params)
    if handle is None:
        return out
    want, k, table = handle
    for r, i in zip(table.tolist(), want):
        if tokens[i] < 0:
            continue
        n = min(params[i].logprobs, k)
        out[i] = TokenLogprobs(r[0], [(int(t), v) for t, v in zip(r[1 + k:1 + k + n], r[1:1 + n])])
    return out


def make_generator(seed: int | None, device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
