"""The errors a user can fix. Each message is one line that names the key, flag or file and the fix; every
CLI turns them into `error: ...` on stderr and exit code 2 (a diverged run: 1)."""

import argparse


class ConfigError(ValueError):
    """A recipe, override or command-line argument is invalid. The message names the key."""


class DataError(ConfigError):
    """The dataset cannot be used as configured. The message names `data.dataset` or the key to change."""


class ExportError(ValueError):
    """Heads cannot be exported as asked (one line: what and how to fix it)."""


class TrainingDiverged(RuntimeError):
    """The run stopped: too many optimizer steps in a row had a non-finite gradient norm, or the heads' weights are
    not finite. Nothing was saved over the last checkpoint."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument (an unknown flag, a value that does not parse) is one line, `error: ...`, and
    exit code 2, like every other bad input; `--help` still prints the usage."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")
