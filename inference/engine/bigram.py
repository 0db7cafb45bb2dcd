"""`BigramDrafter`: a table of each token's most likely successors, built from a dataset with the target's tokenizer
(the classic draft-free baseline), filling static and dynamic trees as every `TreeDrafter` does."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from inference.engine.drafters import TreeDrafter


class BigramDrafter(TreeDrafter):
    """Each token's `top_k` most frequent successors in a corpus (a draft-free baseline).

    table: [V, top_k] successor ids, best first; logq: [V, top_k] their log relative frequencies.
    Tokens never seen as a predecessor fall back to the corpus' most frequent tokens.
    """

    def __init__(self, table: torch.Tensor, logq: torch.Tensor, max_depth: int = 4):
        super().__init__()
        if table.shape != logq.shape or table.dim() != 2:
            raise ValueError(f"bigram table and logq must both be [V, top_k], got {tuple(table.shape)} and "
                             f"{tuple(logq.shape)}")
        self.table, self.logq, self.max_depth = table.long(), logq.float(), max_depth
        self.max_candidates = table.shape[1]

    @classmethod
    def from_token_ids(cls, seqs: Sequence[Sequence[int]] | Sequence[torch.Tensor], vocab_size: int,
                       top_k: int = 4, max_depth: int = 4) -> BigramDrafter:
        """Count successor pairs over token sequences and keep each token's `top_k` best successors."""
        prev, nxt = [], []
        for seq in seqs:
            s = torch.as_tensor(seq, dtype=torch.long).flatten()
            if s.numel() and (int(s.min()) < 0 or int(s.max()) >= vocab_size):
                raise ValueError(f"token ids must lie in [0, {vocab_size}): is vocab_size the target's?")
            prev.append(s[:-1])
            nxt.append(s[1:])
        prev_t = torch.cat(prev) if prev else torch.zeros(0, dtype=torch.long)
        nxt_t = torch.cat(nxt) if nxt else torch.zeros(0, dtype=torch.long)
        # unigram fallback: the most frequent tokens overall
        uni = torch.bincount(nxt_t, minlength=vocab_size).float()
        uni_top = torch.topk(uni + 1e-3 * torch.arange(vocab_size, 0, -1), top_k)  # ties: lower ids first
        uni_logq = torch.log((uni_top.values / uni.sum().clamp_min(1)).clamp_min(1e-6))
        table = uni_top.indices.repeat(vocab_size, 1)
        logq = uni_logq.repeat(vocab_size, 1)
        # pair counts, sparse: unique (prev, next) keys, sorted by prev then count descending
        keys, counts = torch.unique(prev_t * vocab_size + nxt_t, return_counts=True)
        if keys.numel():
            p, n = keys // vocab_size, keys % vocab_size
            order = torch.argsort(p * (counts.max() + 1) - counts, stable=True)
            p, n, counts = p[order], n[order], counts[order]
            first = torch.searchsorted(p, p)  # index of each prev's first pair
            rank = torch.arange(p.numel()) - first
            totals = torch.zeros(vocab_size).index_add_(0, p, counts.float())
            keep = rank < top_k
            table[p[keep], rank[keep]] = n[keep]
            logq[p[keep], rank[keep]] = torch.log(counts[keep].float() / totals[p[keep]])
            # a token with fewer than top_k successors keeps unigram fallbacks in its last slots (a repeated
            # sibling is harmless: verification never accepts a token twice under one parent)
        return cls(table, logq, max_depth)

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer, top_k: int = 4, max_depth: int = 4) -> BigramDrafter:
        """Tokenize `texts` with the target's tokenizer and count successors."""
        seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return cls.from_token_ids(seqs, len(tokenizer), top_k, max_depth)

    def save(self, path: str | os.PathLike) -> None:
        """Write the table as one safetensors file."""
        from safetensors.torch import save_file

        save_file({"table": self.table.cpu().contiguous(), "logq": self.logq.cpu().contiguous()}, str(path),
                  metadata={"max_depth": str(self.max_depth)})

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str | None = None) -> BigramDrafter:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            table, logq = f.get_tensor("table"), f.get_tensor("logq")
        drafter = cls(table, logq, int(meta.get("max_depth", 4)))
        return drafter.to(device) if device is not None else drafter

    def to(self, device: torch.device | str) -> BigramDrafter:
        self.table, self.logq = self.table.to(device), self.logq.to(device)
        self._topologies.clear()
        return self

    def topk_accuracy(self) -> list[list[float]]:
        return [[0.4 * 0.8**k * 0.4**r for r in range(self.table.shape[1])] for k in range(self.max_depth)]

    def propose(self, k, tokens, states, num):
        if self.table.device != tokens.device:
            self.to(tokens.device)
        if num > self.table.shape[1]:
            raise ValueError(f"tree asks for rank {num - 1} but the bigram table keeps only "
                             f"{self.table.shape[1]} successors per token")
        return self.table[tokens, :num], self.logq[tokens, :num], None
