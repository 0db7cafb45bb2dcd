"""`python train.py RECIPE [key=value ...] [--dry-run]` (or `accelerate launch train.py ...`).

Exit codes: 0 the run finished (heads saved); 1 the run diverged (non-finite gradients or weights; the last
checkpoint is kept); 2 bad input (a config, data or target problem: one line
`error: ...` on stderr; the recipe and the data files are checked before any model is loaded); 75 (EX_TEMPFAIL,
"try again") a signal stopped the run after it saved a checkpoint: rerun the same command and `resume: auto`
continues, so a scheduler can requeue on 75 and tell it from a finished run.
"""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, load_config
from .errors import ArgumentParser, TrainingDiverged

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


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 finished, 2 bad input, 75 stopped by a signal: resume)."""
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        if args.dry_run:
            from .data import dry_run_report
            from .target import load_tokenizer

            print(dry_run_report(cfg, load_tokenizer(cfg.target)))
            return 0
        from .trainer import train

        if train(cfg).stopped:
            return EXIT_STOPPED
    except ConfigError as e:  # includes DataError and TargetLoadError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
