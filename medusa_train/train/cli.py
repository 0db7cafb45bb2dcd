"""`python train.py RECIPE [key=value ...] [--dry-run]` (or `accelerate launch train.py ...`, `torchrun ...`).

Exit codes of the training process: 0 the run finished (heads saved); 1 the run diverged (non-finite gradients or
weights, or a loss that exploded; the last good checkpoint is kept); 2 bad input (a config, data or target problem:
one line `error: ...` on stderr, from the first process; the recipe and the data files are checked before any
model is loaded); 75 (EX_TEMPFAIL, "try again") a signal stopped the run after it saved a checkpoint: rerun the same
command and `resume: auto` continues, so a scheduler can requeue on 75 and tell it from a finished run.

A launcher does not pass these on: `accelerate launch` and `torchrun` exit 1 whenever a process fails (and
`accelerate launch` prints a CalledProcessError after our line). So the code is also the trainer's last line,
`train.py: exit code N (...)`, and written to `output_dir/exit_status.json` (main process). Under a launcher the
process asks the kernel for a SIGTERM when its launcher dies, so a launcher killed alone never leaves it running on
as an orphan: it saves a checkpoint and stops as on any SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from ..config import ConfigError, load_config
from ..base.errors import ArgumentParser, TrainingDiverged

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after saving a checkpoint; rerun to resume


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="train.py", description="Train draft heads on a frozen causal LM.",
        epilog="example: accelerate launch train.py recipes/llama-3.1-8b-instruct.yaml train.lr=5e-4 "
               "output_dir=runs/llama")
    parser.add_argument("recipe", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides applied on top of the recipe, e.g. train.lr=1e-4 heads.num_heads=3")
    parser.add_argument("--dry-run", action="store_true",
                        help="print two examples with the supervised spans marked and the token counts, then exit")
    return parser


MEANINGS = {0: "finished, heads saved", 1: "diverged, the last good checkpoint kept", 2: "bad input, nothing trained",
            EXIT_STOPPED: "stopped by a signal after saving a checkpoint: rerun to resume"}


def finish(code: int, output_dir: str | None) -> int:
    """Say the exit code in the last line and in output_dir/exit_status.json (first process only): launchers do not
    pass it on."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"train.py: exit code {code} ({MEANINGS[code]})", flush=True)
        if output_dir and Path(output_dir).is_dir():
            from ..base.files import write_json

            write_json(Path(output_dir) / "exit_status.json", {"code": code, "meaning": MEANINGS[code]})
    return code


OTHERS_WAIT_S = 30.0  # how long a process other than the first leaves the first to say an error they share


def say_error(message: str, rank: int) -> None:
    """The `error:` line, said once. Every process meets the same bad input, but the launcher stops all of them as soon
    as one exits, so a process other than the first that exited at once could have the first killed before it said
    the line. Such a process waits instead: the first says the line and exits, and the launcher ends this one
    (SIGTERM, taken back from the stop handler). An error on this process alone, which the first never meets, is said
    after the wait, with the process named."""
    if rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(OTHERS_WAIT_S)
    print(f"error: (process {rank}) {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 finished, 1 diverged, 2 bad input, 75 stopped by a signal: resume)."""
    args = build_parser().parse_args(argv)
    from .processes import die_with_launcher, launcher_argv

    if launcher_argv() is not None:
        die_with_launcher()
    rank = int(os.environ.get("RANK", "0"))
    output_dir = None
    try:
        cfg = load_config(args.recipe, args.overrides)
        output_dir = cfg.output_dir
        if args.dry_run:
            from ..data.rows import dry_run_report
            from ..target.model import load_tokenizer

            print(dry_run_report(cfg, load_tokenizer(cfg.target)))
            return 0
        from .trainer import train

        if train(cfg).stopped:
            return finish(EXIT_STOPPED, output_dir)
    except ConfigError as e:  # includes DataError and TargetLoadError
        say_error(str(e), rank)
        return finish(2, output_dir)
    except TrainingDiverged as e:
        say_error(str(e), rank)
        return finish(1, output_dir)
    return finish(0, output_dir)


if __name__ == "__main__":
    sys.exit(main())
