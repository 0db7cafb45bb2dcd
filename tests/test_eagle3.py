"""eagle3 heads: the layers they read, the training-time test against inference, exact greedy output, training."""

from __future__ import annotations

import pytest
import torch
from fitted import exact_on_every_tree, fitted
from test_inference_greedy import float64_model
from tiny import tiny_model, tiny_tokenizer

from inference import HeadsDrafter, SpeculativeGenerator
from inference.engine.drafters import DraftContext
from medusa_train.kinds.eagle3 import NORMS
from medusa_train.kinds.heads import default_aux_layers
from medusa_train.kinds.heads import DraftHeads
from medusa_train.target.model import capture_layers, target_hidden

ARCHS = ["llama", "qwen2", "mistral"]


def perturbed(heads: DraftHeads, seed: int, scale: float = 0.05) -> DraftHeads:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return heads


@pytest.mark.parametrize("arch", ARCHS + ["gpt2"])
def test_captured_layers_are_the_inputs_of_those_decoder_layers(arch):
    """Layer id i is what decoder layer i reads (output_hidden_states[i]), 0 the embeddings' output and L the last
    layer's output, in the order asked, without asking the model for every layer."""
    model = tiny_model(arch, layers=4).double()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    want = model.base_model(input_ids=ids, output_hidden_states=True).hidden_states
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())  # transformers' own
    with capture_layers(model, [4, 0, 2]) as got:
        model.base_model(input_ids=ids)
    assert len(got) == 3
    for x, i in zip(got, [4, 0, 2]):
        if i < 4:  # the last entry of hidden_states is after the final norm; layer id 4 is before it
            assert torch.equal(x, want[i]), i
    feats = target_hidden(model, ids, None, [1, 3])
    assert torch.equal(feats[..., :32], want[-1]) and torch.equal(feats[..., 32:64], want[1])
    assert torch.equal(feats[..., 64:], want[3])
    with pytest.raises(ValueError, match="out of range"):
        with capture_layers(model, [5]):
            pass
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks  # all removed


def test_default_aux_layers_are_eagle3s_and_distinct_on_shallow_targets():
    assert default_aux_layers(32) == [2, 16, 29] and default_aux_layers(30) == [2, 15, 27]
    for n in range(1, 12):
        ids = default_aux_layers(n)
        assert len(set(ids)) == len(ids) == min(3, n) and all(1 <= i <= n for i in ids), n


@pytest.mark.parametrize("arch,steps,norms", [
    ("llama", 4, ()), ("qwen2", 3, ()), ("mistral", 2, ()),
    ("llama", 3, ("norm_before_fc",)), ("qwen2", 3, ("norm_before_residual",)), ("mistral", 3, ("norm_output",)),
    ("llama", 3, NORMS)])
def test_training_time_test_states_equal_what_the_drafter_computes_on_the_same_path(arch, steps, norms):
    """Step k of the training forward at position t (reading steps 0..k-1's own states) gives, to float64 rounding,
    the logits the drafter computes for the node at depth k on the true path after committing positions <= t, through
    its committed cache, its packed per-node path and static-tree drafting; with each of EAGLE-3.1's norms too."""
    model = float64_model(arch, seed=1)
    heads = DraftHeads.for_target(model, "eagle3", steps, draft_ids=torch.arange(0, 260, 2), norms=norms)
    assert heads.spec.norms == [n for n in NORMS if n in norms]
    heads = perturbed(heads, 0).double()
    ids = torch.randint(0, 256, (1, 15), generator=torch.Generator().manual_seed(2))
    feats = target_hidden(model, ids, None, heads.target_layers)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        states = heads(feats, ids, embed)  # [K, 1, T, d]
        want = torch.log_softmax(torch.stack([heads.logits(k, states[k]) for k in range(steps)]), dim=-1)
    drafter = HeadsDrafter(heads, model)
    assert drafter.chained and drafter.target_layers == tuple(heads.spec.aux_layers)
    for t in (0, 4, 9):
        drafter.reset()
        with torch.no_grad():
            drafter.observe(feats[0, :t + 1], ids[0, 1:t + 2])  # positions 0..t, each followed by its next token
            state = drafter.root_state(DraftContext(ids[0, t + 1:t + 2], feats[0, t], [], "static", 4))
            for k in range(steps):
                token = ids[0, t + 1 + k:t + 2 + k]  # the node at depth k on the true path
                cand, logq, state = drafter.propose(k, token, state, 5)
                got = torch.full((130,), float("nan"), dtype=torch.float64)
                got[cand[0] // 2] = logq[0].double()
                ref = want[k, 0, t, cand[0] // 2]
                assert torch.allclose(got[cand[0] // 2], ref, atol=1e-9), (t, k)
                assert torch.equal(cand[0] // 2, want[k, 0, t].topk(5).indices), (t, k)


def _trained_eagle3(model, steps: int = 3, iters: int = 60) -> tuple[DraftHeads, torch.Tensor]:
    # max tau 2.1 / 2.2 / 2.1 on llama / qwen2 / mistral
    return fitted(model, DraftHeads.for_target(model, "eagle3", steps).double(), iters, lr=1e-2)


@pytest.mark.parametrize("arch", ARCHS)
def test_eagle3_greedy_output_is_the_targets_on_every_tree_and_with_lookup(arch):
    model = float64_model(arch, seed=0)
    heads, prompts = _trained_eagle3(model)
    taus = exact_on_every_tree(model, heads, prompts[:1])
    assert max(taus) > 1.5, taus  # drafts were accepted: the checks crossed accepted paths


def test_eagle3_sampling_runs_through_the_same_drafter():
    """Temperature > 0 with eagle3 heads (the distribution itself is tested in test_inference_sampling): the same
    seed gives the same output from one generate call to the next, so nothing of a sequence outlives its call (a
    fixed budget: the auto budget's calibration learns across calls and may change the tree)."""
    model = float64_model("llama", seed=0)
    heads, prompts = _trained_eagle3(model, iters=40)
    gen = SpeculativeGenerator(model, tiny_tokenizer(), HeadsDrafter(heads, model))
    prompt = prompts[1:2]
    a = gen.generate(prompt, max_new_tokens=20, temperature=0.8, seed=5, tree_budget=4, eos_token_id=[])
    gen.generate(prompts[2:3], max_new_tokens=9, temperature=0.8, seed=1, tree_budget=4, eos_token_id=[])
    b = gen.generate(prompt, max_new_tokens=20, temperature=0.8, seed=5, tree_budget=4, eos_token_id=[])
    assert a.token_ids.tolist() == b.token_ids.tolist() and len(a.token_ids) == 20


def test_eagle3_heads_round_trip_and_score_their_own_lm_head(tmp_path):
    model = tiny_model("qwen2", layers=6)
    heads = perturbed(DraftHeads.for_target(model, "eagle3", 2, draft_ids=torch.tensor([9, 3, 250, 7])), 1)
    assert heads.spec.aux_layers == [2, 3, 3] or len(set(heads.spec.aux_layers)) == 3
    assert heads.draft_ids.tolist() == [3, 7, 9, 250]  # ordered by target id, as speculators' t2d orders them
    assert heads.owns_lm_head and heads.scoring_weight(1, None) is heads.eagle3.lm_head.weight
    # the LM head starts as the target's rows of the draft vocabulary, the norm as the target's final norm
    fresh = DraftHeads.for_target(model, "eagle3", 2, draft_ids=torch.tensor([9, 3, 250, 7]))
    assert torch.equal(fresh.eagle3.lm_head.weight, model.lm_head.weight[[3, 7, 9, 250]])
    assert torch.equal(fresh.eagle3.norm.weight, model.model.norm.weight)
    heads.save_pretrained(tmp_path)
    back = DraftHeads.from_pretrained(tmp_path, target=model)
    assert back.spec == heads.spec
    for (name, a), (_, b) in zip(heads.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
