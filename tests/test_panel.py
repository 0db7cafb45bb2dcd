"""scripts/panel.py, the script that decides the defaults (docs/results.md, "The panel"): its verdict rule, and that
each trainer gets what the member's target needs. Training and vLLM are replaced by a recorder: what is checked is the
commands the panel runs and the table it draws from measurements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def panel(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import panel

    ran: list[list[str]] = []
    monkeypatch.setattr(panel, "sh", lambda cmd, log=None, env=None: ran.append([str(c) for c in cmd]))
    panel.ran = ran
    return panel


def measured(**runs: list[float]) -> dict:
    """{member: {KIND-RUN-seedS: {"mean_acceptance_length": v}}} from run=[seed 0's, seed 1's] on member "m"."""
    return {"m": {f"eagle3-{r}-seed{s}": {"mean_acceptance_length": v} for r, vals in runs.items()
                  for s, v in enumerate(vals)}}


def row(table: str, run: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"| {run} |"))


def test_a_run_loses_only_by_more_than_the_larger_seed_spread(panel):
    """The rule that keeps or moves a default: a run is marked `<` when the member's best mean beats its own by more
    than either run's spread (max - min over seeds), and not when the gap is inside a spread."""
    result = measured(best=[2.30, 2.32], close=[2.20, 2.36], far=[2.10, 2.12], wide=[1.90, 2.50])
    table = panel.table(result, ["best", "close", "far", "wide"], [0, 1], "eagle3")
    assert row(table, "best").split("|")[2].strip().startswith("2.310 (0.020;")
    assert "<" not in row(table, "close")  # 0.03 behind, its spread 0.16
    assert "< 2.110" in row(table, "far")  # 0.20 behind, spreads 0.02: loses
    assert "<" not in row(table, "wide")  # 0.11 behind, its spread 0.60: a tie
    assert row(panel.table(result, ["best", "missing"], [0, 1], "eagle3"), "missing").endswith("| - |")


def test_speculators_trains_on_the_aux_layers_and_draft_vocabulary_our_rows_were_prepared_with(panel, tmp_path):
    """speculators' default aux layers [2, L//2, L-3] are refused for the panel's 6-layer targets (and would read
    other states than the ones prepared): the panel passes the prepared ones, with our draft vocabulary's size."""
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    data = tmp_path / "code" / "theirs-data"
    data.mkdir(parents=True)
    (data / "prepared.json").write_text(json.dumps({"aux_layers": [1, 4, 6]}))
    spec = {"target": str(target), "rows": str(tmp_path / "rows.jsonl")}
    drafter = panel.theirs(tmp_path, "code", spec, 3, "theirs-512", ["--total-seq-len", "512"], 1)
    (cmd,) = panel.ran  # prepared already: only the training runs
    flags = " ".join(cmd[cmd.index("--") + 1:])
    assert "--target-layer-ids 1 4 6 " in flags + " " and flags.endswith("--total-seq-len 512")
    assert "--epochs 3 " in flags and "--seed 1 " in flags
    from medusa_train.config import CommonHeadsConfig

    assert f"--draft-vocab-size {CommonHeadsConfig().draft_vocab(4096) or 4096} " in flags
    assert drafter == f"eagle3:{tmp_path / 'code' / 'eagle3-theirs-512-seed1' / '2'}"  # its last epoch's checkpoint


def test_each_kind_trains_through_its_own_hidden_cache(panel, tmp_path):
    """eagle3's cached rows hold its aux layers and a chained run refuses such a cache: a member's kinds each get a
    directory, and eagle3 heads are exported for vLLM while chained ones are served from train.py's directory."""
    spec = {"target": "T", "rows": "R"}
    served = {kind: panel.train(tmp_path, "code", spec, kind, 3, "default", ["train.lr=2e-3"], 0)
              for kind in ("eagle3", "chained")}
    trains = [c for c in panel.ran if "train.py" in c]
    caches = [next(a for a in c if a.startswith("train.hidden_cache_dir=")) for c in trains]
    assert len(set(caches)) == 2 and all("train.lr=2e-3" in c and "train.seed=0" in c for c in trains)
    assert any("medusa_train.export" in c for c in panel.ran)
    assert served["eagle3"] == f"eagle3:{tmp_path / 'code' / 'eagle3-default-seed0-export'}"
    heads_alone = "lookup=false,lengths=fixed"  # what training made, without n-gram lookup or the planner's lengths
    assert served["chained"] == f"medusa_train:{tmp_path / 'code' / 'chained-default-seed0'},{heads_alone}"
