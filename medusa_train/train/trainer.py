"""The training loop: an explicit Accelerate loop over a frozen target and trainable draft heads.

    run = setup(cfg)           # accelerator, data, target, heads, optimizer, schedule, resume (`run.py`)
    train_loop(run)            # for each micro-batch:
                               #   h, greedy = run.states(batch)      frozen target (or its cache), no grad
                               #   loss = objective(h, greedy, ...)   heads + chunked KL/CE (only heads learn)
                               #   (target.lora: objective(batch) runs the adapted target too, `joint.py`)
                               #   backward; on a sync step: clip, optimizer step, lr schedule
                               #   every log_every steps: reduce metrics across processes, one host sync, log
                               #   every eval.every steps: held-out eval; every save_every: atomic checkpoint
    finish(run)                # final eval, heads, recipe.yaml, acceptance.json

The rooms beside the loop, one job each: `run.py` (setup), `optim.py` (optimizer and schedule), `processes.py`
(the Accelerator, launchers, stop requests), `metrics.py` (metering, metrics.jsonl, W&B), `divergence.py`,
`checkpoints.py` (write, verify, rotate, resume, compare recipes) and `preflight.py` (the checks before loading).

Outputs in `output_dir`: the heads (`config.json` + `model.safetensors`), `recipe.yaml` (the resolved
config), `acceptance.json` (per-head top-k acceptance, read by the inference engine), `metrics.jsonl`
(one row per log step and per eval), `checkpoints/step-N/` and, with W&B, `wandb/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from .best import LAST_DIR, load_best_heads, write_best, write_heads_dir
from .checkpoints import RECIPE_NAME, save_checkpoint
from ..config import Config
from .divergence import check_finite, check_loss_growth, count_nonfinite
from .evaluate import evaluate, save_acceptance
from ..kinds.heads import DraftHeads
from .joint import held_out_lm_kl, save_adapter
from .metrics import Meter, cache_counts, log_acceptance, log_row, wandb_offline
from .processes import StopRequest, all_agree_to_stop, full_params
from .run import Run, setup
from .tau import measure_tau, rng_devices

STDERR_BAR = 0.02  # an evaluation whose expected tau is less certain than this says so


@dataclass
class TrainResult:
    """What `train` leaves behind: where, how far, and the in-memory heads and (still frozen) target."""

    output_dir: Path
    step: int
    stopped: bool
    """True when a signal stopped the run early (a checkpoint was saved; resume with resume=auto)."""
    heads: DraftHeads
    target: torch.nn.Module
    """The target as trained on: frozen, or (target.lora) with the trained adapters in place."""
    acceptance: dict[str, Any] | None


def train(cfg: Config) -> TrainResult:
    """Train heads per `cfg`; the final heads, recipe.yaml and acceptance.json land in `cfg.output_dir`."""
    run = setup(cfg)
    stopped = train_loop(run)
    return finish(run, stopped)


def micro_step(run: Run, batch: dict[str, torch.Tensor], meter: Meter) -> bool:
    """Forward and backward of one micro-batch; on a sync step also clip and step the optimizer, unless the
    gradient norm is not finite: that step is skipped. Returns False for a skipped step."""
    accelerator = run.accelerator
    finite = True
    with accelerator.accumulate(run.objective):
        if run.peft is None:
            h, greedy = run.states(batch)  # no grad; read from the cache after the first epoch when it is on
            h = h.to(run.embed.weight.dtype)  # a no-op unless target.forward_dtype differs
            loss, stats = run.objective(h, greedy, batch["input_ids"], batch["labels"], batch["attention_mask"],
                                        run.embed, run.lm_head)
        else:  # the adapted target runs inside the objective; after the heads' warm-up its adapters train too
            joint = run.position["step"] >= run.cfg.train.heads_warmup_steps
            loss, stats, lm_kl = run.objective(batch["input_ids"], batch["labels"], batch["attention_mask"],
                                               run.embed, run.lm_head, joint)
            meter.lm_kl += lm_kl
        accelerator.backward(loss)
        meter.add(loss, stats, batch["attention_mask"])
        if accelerator.sync_gradients:
            # the loss is summed over positions: the step's gradient is divided by all of the step's positions, so
            # every supervised token weighs the same, whatever its row's length and the micro-batch it fell in
            torch._foreach_mul_([p.grad for p in run.objective.parameters() if p.grad is not None],
                                meter.step_scale(accelerator))
            meter.grad_norm = accelerator.clip_grad_norm_(run.objective.parameters(),
                                                          run.cfg.train.max_grad_norm or float("inf"))
            # one host read per optimizer step (torch's GradScaler makes the same one to skip a step)
            finite = bool(torch.isfinite(meter.grad_norm))
        if finite:
            run.optimizer.step()  # a no-op on accumulation micro-steps (Accelerate skips it)
        run.optimizer.zero_grad(set_to_none=True)
    return finite


def rng_neutral(batches):
    """`batches`, with the global torch RNG as it was before the first one was fetched: starting a data loader draws
    from it (its workers' base seed), and a resumed run starts one at another point of the stream than the run it
    resumes, so the adapters' dropout (target.lora) would see other masks than the uninterrupted run."""
    it = iter(batches)
    with torch.random.fork_rng(devices=[]):
        first = next(it, None)
    if first is None:
        return
    yield first
    yield from it


def train_loop(run: Run) -> bool:
    """Optimizer steps until `total_steps` or a stop signal; returns True when a signal stopped the run (after
    saving a checkpoint)."""
    from tqdm.auto import tqdm

    cfg, accelerator, position = run.cfg, run.accelerator, run.position
    meter = Meter(cfg.heads.num_heads, accelerator.device, joint=run.peft is not None)
    bar = tqdm(total=run.total_steps, initial=position["step"], disable=not accelerator.is_local_main_process,
               desc="train", dynamic_ncols=True)
    run.objective.train()
    with StopRequest() as stop:
        while position["step"] < run.total_steps and not stop.requested:
            run.train_dl.set_epoch(position["epoch"])
            skip = position["batch_in_epoch"]
            for batch in rng_neutral(accelerator.skip_first_batches(run.train_dl, skip) if skip else run.train_dl):
                finite = micro_step(run, batch, meter)
                position["batch_in_epoch"] += 1
                if not accelerator.sync_gradients:
                    continue
                # -- one optimizer step done (or skipped) ---------------------------------------------------
                run.scheduler.step()
                position["step"] += 1
                step, last = position["step"], position["step"] >= run.total_steps
                bar.update(1)
                count_nonfinite(cfg, accelerator, meter, finite, step)
                if step % cfg.train.log_every == 0 or last:
                    row = meter.row(accelerator, cfg, position, run.scheduler.get_last_lr()[0])
                    row |= cache_counts(accelerator, run.states)
                    if run.peft is not None:  # the adapters' group is the last
                        row["train/adapter_lr"] = run.scheduler.get_last_lr()[-1]
                    log_row(accelerator, cfg, step, row)
                    check_loss_growth(cfg, accelerator, meter, row["train/loss"], step)
                    bar.set_postfix(loss=f"{row['train/loss']:.3f}", acc1=f"{row['train/head1/top1_target']:.3f}",
                                    tok_s=f"{row['train/tokens_per_s']:.0f}")
                if is_eval_step(cfg, step, run.eval_dl is not None) and not last:  # the last one is finish's
                    evaluate_and_keep(run, step, run.eval_dl, "eval")
                    run.objective.train()
                    meter.restart_clock()
                stop.requested = all_agree_to_stop(accelerator, stop.requested)
                if (cfg.train.save_every and step % cfg.train.save_every == 0) or last or stop.requested:
                    with full_params(accelerator, run.objective):
                        check_finite(run.objective, step)  # a checkpoint of garbage would rotate out a good one
                    window = meter.window_loss(accelerator)  # since the last log (None: it was just checked)
                    if window is not None:
                        check_loss_growth(cfg, accelerator, meter, window, step, final=last)
                    if meter.grown_in_a_row:  # heads from an exploding loss would rotate out a good checkpoint
                        accelerator.print(f"step {step}: checkpoint not written: the loss is exploding")
                    else:
                        meter.bank_tokens(accelerator, position)
                        save_checkpoint(accelerator, cfg, position)
                    meter.restart_clock()
                if last or stop.requested:
                    break
            else:  # the epoch ran out
                run.states.end_epoch(run.accelerator.wait_for_everyone)  # the processes share their new rows
                position["epoch"] += 1
                position["batch_in_epoch"] = 0
    bar.close()
    run.states.flush()
    return stop.requested


def is_eval_step(cfg: Config, step: int, held_out: bool) -> bool:
    """A held-out evaluation every eval.every steps, and one with a real-tau run every eval.tau_every steps."""
    return (held_out and bool(cfg.eval.every) and step % cfg.eval.every == 0) or (
        bool(cfg.eval.tau_every) and step % cfg.eval.tau_every == 0)


def evaluate_and_keep(run: Run, step: int, batches, split: str, final: bool = False
                      ) -> tuple[dict[str, float] | None, dict[str, Any] | None, float | None]:
    """One evaluation: the held-out metrics (on `batches`, if any), the real tau on a tau step (and at the end),
    logged together; if the recipe's measure beats the best so far, `best/` is rewritten. Returns (metrics,
    acceptance, the measure's value)."""
    cfg, accelerator = run.cfg, run.accelerator
    # neither evaluation moves the training's RNG (starting the eval loader draws a seed from it; a target's
    # adapter dropout would draw other masks afterwards): on or off, eval.every and eval.tau_every train alike
    with torch.random.fork_rng(devices=rng_devices(accelerator.device)):
        metrics, acceptance = evaluate_heads(run, batches) if batches is not None else (None, None)
        tau = None
        if cfg.eval.tau_every and (final or step % cfg.eval.tau_every == 0):
            tau = real_tau(run, acceptance)
    prefix = "eval" if split == "eval" else "eval_on_train"  # never mixed up with the training rows
    row = {f"{prefix}/{k}": v for k, v in (metrics or {}).items()}
    if tau is not None:
        row |= {"eval/tau": tau["tau"], "eval/tau_tokens_per_s": tau["tokens_per_s"]}
    if metrics is not None and metrics.get("expected_tau_stderr", 0.0) > STDERR_BAR:
        accelerator.print(f"step {step}: held-out expected tau {metrics['expected_tau']:.3f} +- "
                          f"{metrics['expected_tau_stderr']:.3f} (bootstrap): raise eval.max_batches (0: the whole "
                          "split) or data.eval_size for an error under 0.02")
    best = run.best
    value = best.score(cfg, metrics, tau)
    if best.beaten_by(value):
        best.step, best.value = step, float(value)
        with full_params(accelerator, run.objective):
            if accelerator.is_main_process:
                write_best(cfg, best, run.heads, acceptance or {}, split, {"steps": step, "keep_best": best.metric})
        accelerator.wait_for_everyone()
    if best.step >= 0:
        row |= best.row()
    log_row(accelerator, cfg, step, row)
    if acceptance is not None:
        log_acceptance(accelerator, cfg, step, acceptance, final)
    return metrics, acceptance, value


def real_tau(run: Run, acceptance: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's tau with the heads as they are (`tau.measure_tau`): every process generates on its share of the
    prompts (so none waits in a collective while another generates, however many prompts there are), and the sums of
    all of them give every process the result: the same as one process generating on all of them."""
    cfg, accelerator = run.cfg, run.accelerator
    mine = run.tau_prompts[accelerator.process_index::accelerator.num_processes]
    with full_params(accelerator, run.objective):
        part = measure_tau(run.heads, run.target, acceptance["topk_accuracy"] if acceptance else None, mine,
                           cfg.eval.tau_budget, cfg.eval.tau_max_new_tokens)
    sums = torch.tensor([part["new_tokens"], part["target_forwards"], part["seconds"], part["prompts"]],
                        dtype=torch.float64, device=accelerator.device)
    new, forwards, seconds, prompts = accelerator.reduce(sums, "sum").tolist()
    return {"tau": new / max(forwards, 1), "tokens_per_s": new / max(seconds, 1e-9), "new_tokens": int(new),
            "target_forwards": int(forwards), "prompts": int(prompts)}


def evaluate_heads(run: Run, batches) -> tuple[dict[str, float], dict[str, Any]]:
    """Held-out metrics and acceptance of the heads as they are (FSDP gathers their shards first); in joint training
    on the adapted target, with `lm_kl`: its mean KL to the original target per supervised position."""
    run.objective.eval()  # the adapters' dropout off (the loop turns training back on)
    with full_params(run.accelerator, run.objective):
        metrics, acceptance = evaluate(run.heads, run.target, batches, run.cfg.loss, run.cfg.eval.max_batches,
                                       run.accelerator, budgets=[*run.cfg.eval.tree_budgets, run.cfg.eval.tau_budget])
    if run.peft is not None:
        metrics["lm_kl"] = held_out_lm_kl(run.peft, batches, run.cfg.eval.max_batches, run.cfg.loss.chunk_size,
                                          run.accelerator)
    return metrics, acceptance


def finish(run: Run, stopped: bool) -> TrainResult:
    """After the loop: a stopped run says how to resume; a finished one writes the final heads, recipe.yaml and
    acceptance.json (measured on the held-out split, else on training batches)."""
    cfg, accelerator, position = run.cfg, run.accelerator, run.position
    out = Path(cfg.output_dir)
    if stopped:
        accelerator.print(f"stopped at step {position['step']}; resume with resume=auto (the default)")
        accelerator.end_training()
        return TrainResult(out, position["step"], True, run.heads, run.target, None)

    split, batches = ("eval", run.eval_dl) if run.eval_dl is not None else ("train", run.train_dl)
    if run.eval_dl is None:
        accelerator.print("no held-out split (data.eval_size=0): acceptance.json is measured on training batches")
    with full_params(accelerator, run.objective):
        check_finite(run.objective, position["step"])
    step, best = position["step"], run.best
    _, acceptance, last_value = evaluate_and_keep(run, step, batches, split, final=True)
    if 0 <= best.step < step:  # the run ends with the best heads, not the last (keep_best=last never has a best)
        with full_params(accelerator, run.objective):
            if accelerator.is_main_process:  # the last heads stay at hand, to compare
                write_heads_dir(out / LAST_DIR, run.heads, acceptance, split, step, {"steps": step})
        acceptance = load_best_heads(cfg, accelerator, run.objective, run.heads)
        accelerator.print(f"keep_best={best.metric}: the run ends with the heads of step {best.step} ({best.metric} "
                          f"{best.value:.3f}; the last step's: {last_value:.3f}); train.keep_best=last keeps the last")
    if accelerator.is_main_process:
        training = {"steps": position["step"], "tokens": position["tokens"], "recipe": RECIPE_NAME}
        if best.step >= 0:
            training |= {"best_step": best.step, "keep_best": best.metric, best.metric: best.value}
        if cfg.heads.init_from:
            training["init_from"] = str(cfg.heads.init_from)
        if run.peft is not None:  # the adapter first: the heads' config names it, as the target they draft for
            run.heads.spec.target_fingerprint["adapter"] = save_adapter(run.peft, out)
            training["joint"] = {"lora_r": cfg.target.lora.r, "heads_warmup_steps": cfg.train.heads_warmup_steps}
        with full_params(accelerator, run.objective):
            run.heads.save_pretrained(out, extra={"training": training})
    if best.step >= 0:
        log_row(accelerator, cfg, step, best.row() | {"best/final": True})
    if accelerator.is_main_process:
        (out / RECIPE_NAME).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        save_acceptance(out, acceptance, split)
        taus = ", ".join(f"{b} nodes {t:.3f}" for b, t in acceptance["expected_tau_tree"].items())
        accelerator.print(f"heads saved to {out} (expected tau of a chain: {acceptance['expected_tau']:.3f}; of the "
                          f"best static tree: {taus})")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if cfg.tracking.backend == "wandb" and accelerator.is_main_process and wandb_offline():
        runs = sorted((out / "wandb").glob("offline-run-*"))
        if runs:
            accelerator.print(f"wandb: to upload this run: wandb sync {runs[-1]}")
    return TrainResult(out, position["step"], False, run.heads, run.target, acceptance)
