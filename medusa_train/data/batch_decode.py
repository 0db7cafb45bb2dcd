"""Many generations at once with continuous batching: what distillation spends its time on.

`model.generate` on a batch keeps decoding every row until the longest one ends, so a row that stopped after 40
tokens still costs a forward row for each of the others' remaining steps, and nothing joins the batch until all are
done. `decode` keeps up to `batch_size` rows in flight over one left-padded key/value cache: waiting prompts join
when a quarter of the slots are free (their prompts prefilled together, that cache left-padded to the batch's length
and appended), rows that ended are dropped then (until then they ride along, their tokens ignored: one copy of the
cache drops a quarter of the rows at once), and so are the columns that every row holds as padding.
Each row is sampled with a generator of its own (`seeds`), so a row's sample does not depend on which rows shared
its batch; greedy rows need none.

Plain key/value caches only (every layer a `DynamicLayer`): for a model with sliding-window, recurrent or other
cache layers, `decode` falls back to `model.generate` on batches of `batch_size`, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..target.model import cache_kwargs

REFILL = 0.25  # prompts join when this share of the slots is free: a prefill per one or two rows would cost more


NUCLEUS_K = 256  # the nucleus is looked for among each row's top 256 tokens first: sorting 49k costs more than a step


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's most likely tokens in descending order, those past the smallest prefix whose mass reaches `top_p`
    zeroed: (probabilities, token ids). Taken from the top NUCLEUS_K tokens when they hold the nucleus (one host
    sync; sorting the whole vocabulary, as transformers' top-p warper does, took longer than SmolLM2's forward on a
    CPU), else from the full sort."""
    k = min(NUCLEUS_K, probs.shape[-1])
    vals, order = probs.topk(k, dim=-1)
    if k < probs.shape[-1] and not bool((vals.sum(-1) >= top_p).all()):
        vals, order = probs.sort(dim=-1, descending=True)
    drop = vals.cumsum(-1) - vals >= top_p  # a token stays while the mass above it is short of top_p
    return vals.masked_fill(drop, 0.0), order


def _top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Probabilities of each row's next token after temperature and nucleus (top-p) filtering, renormalized."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        vals, order = _nucleus(probs, top_p)
        probs = torch.zeros_like(probs).scatter_(-1, order, vals)
    return probs / probs.sum(-1, keepdim=True)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gens: Sequence[torch.Generator | None]
            ) -> torch.Tensor:
    """One token per row from its `_top_p` distribution by the inverse CDF, with one uniform draw from the row's own
    generator (a row without one, a row that ended, gets any token). One multinomial call per row cost a third of a
    step on a CPU; this is a cumulative sum and one batched search."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    vals, order = _nucleus(probs, top_p) if top_p < 1.0 else (probs, None)
    cdf = vals.cumsum(-1)
    u = torch.cat([torch.rand(1, generator=g, device=g.device) if g is not None else torch.full((1,), 0.5)
                   for g in gens]).to(cdf.device)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)
    return (idx if order is None else order.gather(-1, idx))[:, 0]


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] padded on the left with `pad_id`, and the attention mask that marks the real tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[r, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _plain_cache(cache) -> bool:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _left_pad(cache, width: int) -> None:
    """Pads every layer's keys and values on the left (the sequence axis) to `width` columns."""
    for layer in cache.layers:
        extra = width - layer.keys.shape[-2]
        if extra > 0:
            pad = (0, 0, extra, 0)
            layer.keys = torch.nn.functional.pad(layer.keys, pad)
            layer.values = torch.nn.functional.pad(layer.values, pad)


def _concat(cache, other) -> None:
    for layer, new in zip(cache.layers, other.layers):
        layer.keys = torch.cat([layer.keys, new.keys])
        layer.values = torch.cat([layer.values, new.values])


def _cut_left(cache, columns: int) -> None:
    for layer in cache.layers:
        layer.keys = layer.keys[..., columns:, :]
        layer.values = layer.values[..., columns:, :]


@torch.inference_mode()
def decode(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stops: Sequence[int], pad_id: int,
           batch_size: int = 32, temperature: float = 0.0, top_p: float = 1.0, seeds: Sequence[int] | None = None,
           limits: Sequence[int] | None = None) -> Iterator[tuple[int, list[int], bool]]:
    """Yields (prompt index, new tokens up to the first stop token, stopped) for every prompt, as each one ends
    (in that order, not the prompts'). Greedy at `temperature` 0; else sampled with `top_p`, prompt i from a
    generator seeded `seeds[i]`. Prompt i gets at most `limits[i]` new tokens (default `max_new_tokens` each; a
    limit under 1 yields no tokens). A `model` that generates itself (`VllmTarget`: vLLM in its own venv) is handed
    the whole call."""
    if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("decode: sampling needs one seed per prompt")
    limit = [max_new_tokens] * len(prompts) if limits is None else [int(n) for n in limits]
    if hasattr(model, "generate_tokens"):
        yield from model.generate_tokens(prompts, limit, stops, temperature, top_p, seeds)
        return
    for i in [i for i, n in enumerate(limit) if n < 1]:
        yield i, [], False
    stop_set = set(int(t) for t in stops)
    device = model.device
    waiting = [i for i in range(len(prompts)) if limit[i] >= 1][::-1]  # popped from the end: prompt order
    rows: list[int | None] = []  # prompt index of each cache row; None: it ended, its row not yet dropped
    out: dict[int, list[int]] = {}
    gens: dict[int, torch.Generator] = {}
    cache = mask = positions = last = None

    def pick(logits: torch.Tensor, batch: list[int | None]) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        return _sample(logits, temperature, top_p, [gens[i] if i is not None else None for i in batch])

    def compact() -> None:
        """Drops the rows that ended (one copy of the cache for all of them) and the columns no row attends to."""
        nonlocal cache, mask, positions, last, rows
        keep = [r for r, i in enumerate(rows) if i is not None]
        if not keep:
            cache = mask = positions = last = None
            rows = []
            return
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, positions, last = mask[index], positions[index], last[index]
            rows = [rows[r] for r in keep]
        empty = int((mask.sum(0) == 0).long().cumprod(0).sum())  # leading columns no row attends to
        if empty:
            _cut_left(cache, empty)
            mask = mask[:, empty:]

    threshold = max(1, int(batch_size * REFILL))
    while waiting or any(i is not None for i in rows):
        alive = sum(i is not None for i in rows)
        refill = bool(waiting) and (alive == 0 or batch_size - alive >= threshold)
        if refill or len(rows) - alive >= threshold or alive == 0:
            compact()  # rows that ended ride along (their tokens ignored) until enough of them pay for a copy
        if refill:
            batch = [waiting.pop() for _ in range(min(batch_size - alive, len(waiting)))]
            for i in batch:
                out[i] = []
                if temperature > 0:
                    gens[i] = torch.Generator(device=device).manual_seed(int(seeds[i]))
            c, m, pos, logits = _prefill(model, [prompts[i] for i in batch], pad_id)
            if not _plain_cache(c):  # a cache we cannot splice (the first prefill tells): generate() instead
                yield from _generate_fallback(model, prompts, [*batch, *waiting[::-1]], limit, stops,
                                              pad_id, batch_size, temperature, top_p, seeds)
                return
            nxt = pick(logits, batch)
            cache, mask, positions, last = (c, m, pos, nxt) if cache is None else \
                _joined((cache, mask, positions, last), (c, m, pos, nxt))
            check = range(len(rows), len(rows) + len(batch))  # the rows in flight wait for this prefill
            rows += batch
        else:
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            logits = model(input_ids=last[:, None], attention_mask=mask, position_ids=positions[:, None],
                           use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
            positions = positions + 1
            last = pick(logits, rows)
            check = range(len(rows))
        tokens = last.tolist()  # the one host sync of a step
        for r in check:
            i, t = rows[r], tokens[r]
            if i is None:
                continue
            if t in stop_set or len(out[i]) + 1 >= limit[i]:
                stopped = t in stop_set
                if not stopped:
                    out[i].append(t)
                yield i, out.pop(i), stopped
                gens.pop(i, None)
                rows[r] = None
            else:
                out[i].append(t)


def _prefill(model, prompts: list[Sequence[int]], pad_id: int):
    """A new cache for `prompts` (left-padded): (cache, mask, each row's next position, the last logits)."""
    from transformers import DynamicCache

    ids, m = _left_padded(prompts, pad_id, model.device)
    pos = (m.cumsum(-1) - 1).clamp(min=0)
    c = DynamicCache(config=model.config)
    logits = model(input_ids=ids, attention_mask=m, position_ids=pos, use_cache=True, logits_to_keep=1,
                   **cache_kwargs(model, c)).logits[:, -1]
    return c, m, pos[:, -1] + 1, logits


def _joined(running: tuple, new: tuple) -> tuple:
    """The rows in flight (cache, mask, positions, last tokens) with a new prefill's appended, both left-padded to
    one width."""
    cache, mask, positions, last = running
    c, m, pos, nxt = new
    width = max(mask.shape[1], m.shape[1])
    _left_pad(cache, width)
    _left_pad(c, width)
    _concat(cache, c)
    mask = torch.cat([torch.nn.functional.pad(mask, (width - mask.shape[1], 0)),
                      torch.nn.functional.pad(m, (width - m.shape[1], 0))])
    return cache, mask, torch.cat([positions, pos]), torch.cat([last, nxt])


def _generate_fallback(model, prompts, todo, limit, stops, pad_id, batch_size, temperature, top_p, seeds
                       ) -> Iterator[tuple[int, list[int], bool]]:
    """`model.generate` on batches of `batch_size` of the prompts in `todo` (sampling seeded by each batch's first
    prompt; each batch runs to its largest limit, each row cut at its own): for caches `decode` cannot splice."""
    stop_set = set(int(t) for t in stops)
    for b in range(0, len(todo), batch_size):
        batch = todo[b:b + batch_size]
        ids, m = _left_padded([prompts[i] for i in batch], pad_id, model.device)
        width = ids.shape[1]
        kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=None) if temperature > 0 else \
            dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        if temperature > 0:
            torch.manual_seed(int(seeds[batch[0]]))
        seqs = model.generate(input_ids=ids, attention_mask=m, max_new_tokens=max(limit[i] for i in batch),
                              pad_token_id=pad_id, eos_token_id=list(stops), **kw)
        for i, row in zip(batch, seqs[:, width:].tolist()):
            row = row[:limit[i]]
            stop = next((k for k, t in enumerate(row) if t in stop_set), None)
            yield i, row if stop is None else row[:stop], stop is not None
