"""The training run: setup, the loop, losses, evaluation, checkpoints, the real tau, the best heads, processes."""
