"""Tiny random models of any architecture transformers ships, and the engine's checks on one of them: exact greedy
output for every drafter kind (planted oracles forcing long accepted paths, random heads of every kind, n-gram
lookup) over static and dynamic trees, sampling that runs, or a one-line refusal at load.

Used by `tests/test_architectures.py` (a fast, fixed selection) and `scripts/arch_sweep.py` (every model type).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch

TINY = dict(vocab_size=260, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=512, head_dim=8, n_embd=32, n_layer=2, n_head=4,
            d_model=32, ffn_dim=64, n_positions=512, num_layers=2, num_heads=4, n_inner=64, moe_intermediate_size=16,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=8,
            q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, word_embed_proj_dim=32,
            shared_expert_intermediate_size=16, sliding_window=64, attention_chunk_size=64)
SPECIAL = dict(pad_token_id=259, bos_token_id=256, eos_token_id=258)
MAX_PARAMS = 30_000_000


def tiny_config(model_type: str, **overrides):
    """The config class's defaults shrunk to a tiny model (keys it does not have are left alone); a hybrid's
    `layer_types` keeps its pattern over the first layers, so attention and its other kind both stay."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    keys = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    pattern = list(overrides.get("layer_types") or getattr(config, "layer_types", None) or [])
    for k, v in (TINY | SPECIAL | overrides).items():
        if k in keys:
            try:
                setattr(config, k, v)
            except (AttributeError, TypeError, ValueError):
                pass
    if pattern:
        kinds = list(dict.fromkeys(pattern))  # every kind of layer the architecture has, in order of appearance
        n = max(2, len(kinds))
        layers = [pattern[i] for i in range(n) if i < len(pattern)]
        for kind in kinds:  # make sure each kind appears among the first n layers
            if kind not in layers:
                layers[-1] = kind
        try:
            config.num_hidden_layers = n
            config.layer_types = layers
        except AttributeError:  # derived from other fields (a property without a setter)
            pass
    return config


def tiny_model(model_type: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """A random tiny causal LM of `model_type` in eval mode (float64, else float32 where its kernels take no
    float64), or a string saying why none could be built."""
    built = _tiny_model(model_type, dtype, seed, **overrides)
    if isinstance(built, str) and dtype == torch.float64 and "Double" in built:
        return _tiny_model(model_type, torch.float32, seed, **overrides)
    return built


def _tiny_model(model_type: str, dtype: torch.dtype, seed: int, **overrides):
    from transformers import AutoModelForCausalLM

    try:
        config = tiny_config(model_type, **overrides)
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if n > MAX_PARAMS:
            return f"its config does not shrink ({n / 1e6:.0f}M parameters)"
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
        # sharp attention, so a node verified at the wrong position or seeing the wrong tokens changes the output
        with torch.no_grad():
            for module in model.modules():
                for name in ("q_proj", "k_proj", "query_key_value", "c_attn", "Wqkv", "qkv_proj"):
                    layer = getattr(module, name, None)
                    if isinstance(layer, torch.nn.Linear):
                        layer.weight.mul_(8.0)
        ids = torch.randint(0, 250, (1, 6))
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                       pad_token_id=259)
        return model
    except Exception as e:  # noqa: BLE001 - the architecture's own code failed on our tiny config
        return f"not built from a tiny config ({type(e).__name__}: {' '.join(str(e).split())[:100]})"


@dataclass
class Row:
    model_type: str
    status: str  # exact | refused | not built | MISMATCH | CRASH
    detail: str = ""


def greedy_reference(model, input_ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(input_ids, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         attention_mask=torch.ones_like(input_ids), pad_token_id=259, eos_token_id=None)
    return out[0, input_ids.shape[1]:].tolist()


def check_model(model_type: str, model,
                kinds: tuple[str, ...] = ("chained", "parallel", "eagle3", "dflash", "dspark"), max_new: int = 20) -> Row:
    """Every drafter on `model`: exact greedy output, sampling that runs; or the engine's one-line refusal."""
    from test_inference_greedy import PlantedDrafter

    from inference import HeadsDrafter, NGramDrafter, SpeculativeGenerator, UnsupportedModelError
    from medusa_train.kinds.heads import DraftHeads

    vocab = model.get_output_embeddings().weight.shape[0]
    input_ids = torch.randint(0, min(vocab, 250), (1, 9), generator=torch.Generator().manual_seed(1))
    input_ids = torch.cat([input_ids, input_ids[:, :5]], 1)  # something for lookup to find
    try:
        truth_new = greedy_reference(model, input_ids, max_new + 6)
        truth = input_ids[0].tolist() + truth_new
        want = truth_new[:max_new]
        drafters = {"oracle": lambda: PlantedDrafter(truth, vocab, 4, true_rank=0),
                    "oracle-rank1": lambda: PlantedDrafter(truth, vocab, 3, true_rank=1, good_depth=2),
                    "ngram": lambda: NGramDrafter(max_ngram=3, max_depth=3, branches=2)}
        for kind in kinds:
            def heads(kind=kind):
                h = DraftHeads.for_target(model, kind=kind, num_heads=3)
                gen = torch.Generator().manual_seed(3)
                with torch.no_grad():
                    for p in h.parameters():
                        p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
                return HeadsDrafter(h, model)
            drafters[kind] = heads
        try:
            SpeculativeGenerator(model, None, drafters["oracle"]())
        except UnsupportedModelError as e:
            message = str(e)
            if "\n" in message:
                return Row(model_type, "CRASH", f"a refusal of more than one line: {message[:200]}")
            return Row(model_type, "refused", message)
        for name, make in drafters.items():
            try:
                gen = SpeculativeGenerator(model, None, make(), self_check=False)
            except UnsupportedModelError as e:  # e.g. eagle3 heads on a target without reachable layers
                if "\n" in str(e) or name not in kinds:
                    raise
                continue
            for tree in ("static", "dynamic"):
                out = gen.generate(input_ids, max_new_tokens=max_new, tree=tree, tree_budget=6, eos_token_id=[])
                got = out.token_ids.tolist()
                if got != want:
                    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    return Row(model_type, "MISMATCH", f"{name}, {tree} tree: first differs at token {first}")
                if name == "oracle" and tree == "static" and out.stats.tau < 2:
                    return Row(model_type, "MISMATCH", f"the oracle was accepted at tau {out.stats.tau:.2f} only")
            gen.generate(input_ids, max_new_tokens=8, temperature=1.0, seed=0, eos_token_id=[])
        return Row(model_type, "exact", ", ".join(drafters))
    except Exception as e:  # noqa: BLE001 - a sweep reports every failure as a row
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return Row(model_type, "CRASH", f"{type(e).__name__}: {' '.join(str(e).split())[:160]} "
                                        f"({tb.filename.rsplit('/', 2)[-1]}:{tb.lineno})")


# the settings real checkpoints of these architectures use, where the config's defaults leave them out: ALiBi Falcons
# (falcon-rw), LFM2's convolution layers, a soft cap and scales that the tiny model's logits really reach
VARIANTS = {
    "falcon alibi=True": ("falcon", dict(alibi=True)),
    "lfm2 with conv layers": ("lfm2", dict(layer_types=["conv", "full_attention"])),
    "gemma2 cap reached": ("gemma2", dict(final_logit_softcapping=0.05)),
    "granite logits_scaling=8": ("granite", dict(logits_scaling=8.0)),
    "cohere logit_scale=4": ("cohere", dict(logit_scale=4.0)),
}


def causal_lm_types() -> list[str]:
    """Every model type `AutoModelForCausalLM` knows, then the variants."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) + list(VARIANTS)


def sweep_one(name: str) -> Row:
    model_type, overrides = VARIANTS.get(name, (name, {}))
    model = tiny_model(model_type, **overrides)
    if isinstance(model, str):
        return Row(name, "not built", model)
    return check_model(name, model)
