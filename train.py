"""Train draft heads: `accelerate launch train.py recipes/<recipe>.yaml [key=value ...] [--dry-run]`."""

import sys

from medusa_train.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
