"""The vLLM plugin's parts that need no vLLM (`inference.vllm_plugin`): its drafts equal our engine's for every head
layout it serves, the logits row it picks for each request, and its one-line refusals. `tests/test_vllm.py` (`pytest -m
vllm`) serves heads through it in vLLM itself."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model
from torch import nn

from inference.engine.drafters import DraftContext, HeadsDrafter
from inference.vllm_plugin import HeadsProposer, heads_refusal, rows_to_draft
from medusa_train.kinds.heads import DraftHeads, HeadsMismatchError
from medusa_train.target.model import target_hidden

K = 3


class VllmLikeTarget(nn.Module):
    """What the plugin reads of a vLLM model, around a transformers one: `embed_input_ids`, `compute_logits`, and the
    embedding and LM head weights with vLLM's padding to a multiple of 64 rows."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        emb, out = hf.get_input_embeddings().weight.detach(), hf.get_output_embeddings().weight.detach()
        rows = -(-emb.shape[0] // 64) * 64
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(rows, emb.shape[1])
        self.lm_head = nn.Linear(emb.shape[1], rows, bias=False)
        with torch.no_grad():
            self.model.embed_tokens.weight.zero_()[:emb.shape[0]] = emb
            self.lm_head.weight.zero_()[:out.shape[0]] = out

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor:
        return F.linear(states, self.lm_head.weight)


def proposer(heads_dir, target: nn.Module, tensor_parallel: int = 1) -> HeadsProposer:
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(model=str(heads_dir), num_speculative_tokens=K),
        model_config=SimpleNamespace(dtype=torch.float32, get_vocab_size=lambda: target.config.vocab_size,
                                     max_model_len=512),
        parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel))
    p = HeadsProposer(config)
    p.load_model(VllmLikeTarget(target))
    return p


def trained_like(target: nn.Module, kind: str, **options) -> DraftHeads:
    """Heads of `kind` with their weights moved away from the initialisation (which passes h_t through unchanged, so
    an untrained head repeats the target's own guess and cannot tell a skipped head from a good one)."""
    heads = DraftHeads.for_target(target, kind, num_heads=K, **options)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "lm_heads" not in name else 0.02))
    return heads


LAYOUTS = {
    "chained, draft vocabulary": dict(kind="chained", draft_ids=torch.arange(0, 260, 2)),
    "chained, mlp_speculator block": dict(kind="chained", block="mlp_speculator"),
    "chained, own embedding and LM heads, 2 blocks": dict(kind="chained", own_embed=True, own_lm_head=True,
                                                          layers_per_head=2),
    "parallel": dict(kind="parallel"),
    "parallel, draft vocabulary": dict(kind="parallel", draft_ids=torch.arange(100, 228)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_the_plugin_drafts_what_our_engine_drafts(layout, tensor_parallel, tmp_path):
    """For many positions at once (one row a request, as vLLM batches them), the plugin's chain equals the greedy
    chain our engine drafts from the same state and token; with tensor parallelism it scores through compute_logits."""
    target = tiny_model("llama", seed=3, hidden=64, layers=2)
    heads = trained_like(target, **LAYOUTS[layout])
    heads.save_pretrained(tmp_path / "heads")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = target_hidden(target, ids)[0]
    drafter = HeadsDrafter(DraftHeads.from_pretrained(tmp_path / "heads", target), target)
    chain = [[0] * d for d in range(1, K + 1)]
    positions = list(range(1, 40, 3))
    want, want_p = [], []
    for p in positions:
        with torch.no_grad():
            tree = drafter.draft(DraftContext(ids[0, p:p + 1], h[p - 1], ids[0, :p + 1].tolist(), chain, K))
        want.append([int(tree.tokens[tree.depth == d][0]) for d in range(1, K + 1)])
        path_logp = torch.cat([torch.zeros(1), tree.scores[1:K + 1].float()])  # the engine's scores: the path's log p
        want_p.append((path_logp[1:] - path_logp[:-1]).exp().tolist())
    got, got_p = proposer(tmp_path / "heads", target, tensor_parallel).draft(h[[p - 1 for p in positions]],
                                                                             ids[0, positions], K)
    assert got.tolist() == want
    torch.testing.assert_close(got_p, torch.tensor(want_p), rtol=1e-4, atol=1e-5)  # each token's own head's p
    assert len({tuple(w) for w in want}) > 3  # the drafts vary with the position: a wrong row or token would show


def test_fewer_tokens_than_heads_draft_the_first_heads(tmp_path):
    target = tiny_model("llama", seed=3, hidden=64, layers=2)
    trained_like(target, "chained").save_pretrained(tmp_path / "heads")
    p = proposer(tmp_path / "heads", target)
    h, last = torch.randn(5, 64), torch.arange(5)
    (two, p_two), (three, p_three) = p.draft(h, last, 2), p.draft(h, last, K)
    assert two.tolist() == [row[:2] for row in three.tolist()]
    assert torch.equal(p_two, p_three[:, :2]) and bool(((p_three > 0) & (p_three <= 1)).all())


def test_each_request_drafts_from_the_row_of_its_last_sampled_token():
    """Logits rows come a request's scheduled drafts + 1 at a time; a request that sampled n tokens (n-1 drafts
    accepted) drafts from its row n-1; one that sampled none (a prefill chunk) drafts nothing."""
    sampled = [[5], [], [7, 8, 9], [4, 2], [6, 1, 3, 0]]
    live, rows, last = rows_to_draft(sampled, [3, 0, 3, 2, 3])
    assert live == [0, 2, 3, 4]
    assert rows == [0, 4 + 1 + 2, 9 + 1, 12 + 3]
    assert last == [5, 9, 2, 0]
    assert rows_to_draft([[1], [2], []], None) == ([0, 1], [0, 1], [1, 2])  # no drafts this step: one row each


def test_heads_for_another_target_are_refused_when_they_load(tmp_path):
    target = tiny_model("llama", seed=3, hidden=64, layers=2)
    trained_like(target, "chained").save_pretrained(tmp_path / "heads")
    other = tiny_model("llama", seed=4, hidden=64, layers=2)  # same sizes, other weights
    with pytest.raises(HeadsMismatchError, match="do not fit this target: its embedding weights differ"):
        proposer(tmp_path / "heads", other)


def test_heads_it_cannot_serve_are_refused_in_one_line(tmp_path):
    target = tiny_model("llama", seed=3, hidden=64, layers=2)
    DraftHeads.for_target(target, "eagle3", num_heads=K, target_name="tiny").save_pretrained(tmp_path / "eagle3")
    DraftHeads.for_target(target, "chained", num_heads=K, context_layers=1).save_pretrained(tmp_path / "context")
    DraftHeads.for_target(target, "parallel", num_heads=K, target_name="tiny").save_pretrained(tmp_path / "ok")
    cases = {
        (tmp_path / "eagle3", 64, 260, K): "export them (python -m medusa_train.export",
        (tmp_path / "context", 64, 260, K): "train servable heads with heads.context_layers=0",
        (tmp_path / "ok", 128, 260, K): "trained for a target of hidden size 64 and vocabulary 260 (trained for tiny)",
        (tmp_path / "ok", 64, 32000, K): "this target has 64 and 32000",
        (tmp_path / "ok", 64, 260, K + 1): f"num_speculative_tokens is {K + 1}, and these heads draft 1 to {K}",
        (tmp_path / "missing", 64, 260, K): "is not a heads directory",
    }
    for args, phrase in cases.items():
        why, _ = heads_refusal(*args)
        assert why is not None and phrase in why and "\n" not in why, (args, why)
    assert heads_refusal(tmp_path / "ok", 64, 260, K)[0] is None
    assert heads_refusal(tmp_path / "ok", 64, 260, None)[0] is None  # vLLM then drafts one token a head


def dspark_config(**hf) -> SimpleNamespace:
    """A speculative config as vLLM resolves `"method": "dspark"` for our export (the keys `as_dflash` reads)."""
    hf = SimpleNamespace(**({"architectures": ["Qwen3DSparkModel"], "sample_from_anchor": False,
                            "enable_confidence_head": True} | hf))
    return SimpleNamespace(method="dspark", draft_sample_method="greedy", enable_adaptive_verification=True,
                           draft_model_config=SimpleNamespace(hf_config=hf))


def test_dspark_is_handed_to_v1s_dflash_proposer_or_refused_in_one_line():
    """On vLLM's V1 runner our export's DSpark config becomes `dflash` with the DSpark settings kept for the workers
    (adaptive verification taken over by the plugin); what V1 cannot draft is refused in one line naming the fix; a
    DSpark of another architecture is left to vLLM."""
    from inference.vllm_dspark import KEY, as_dflash

    config = dspark_config()
    as_dflash(config)
    assert (config.method, config.enable_adaptive_verification) == ("dflash", False)
    assert getattr(config.draft_model_config.hf_config, KEY) == {"adaptive": True}
    other = dspark_config(architectures=["DSparkDraftModel"])
    as_dflash(other)
    assert other.method == "dspark"
    refused = {"samples from its anchor": dspark_config(sample_from_anchor=True),
               "drafts greedily": SimpleNamespace(**(vars(dspark_config()) | {"draft_sample_method": "probabilistic"})),
               "has none: train one with heads.confidence_head=true": dspark_config(enable_confidence_head=False)}
    for words, config in refused.items():
        with pytest.raises(ValueError, match=words) as e:
            as_dflash(config)
        assert "\n" not in str(e.value) and config.method == "dspark"
