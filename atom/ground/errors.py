"""The errors a user can cause, in one light module (no torch): the CLI renders each as one
line `atom: error: ...` and exits 2, and commands that never touch a model (`atom peers`,
`atom keygen`) can import them without paying for torch."""

from __future__ import annotations


class AtomError(Exception):
    """A user-caused problem; the message is one line naming the problem and the fix."""


class ConfigError(AtomError):
    """A configuration problem (bad YAML, an invalid value, a plan that does not fit)."""


class DataError(AtomError):
    """A data problem (missing or malformed input, a dataset that does not match)."""


class TrainingError(AtomError):
    """Training went where it must not go on (diverged or poisoned weights): the run
    stops, the newest good checkpoint stays the newest."""


class CheckpointError(AtomError):
    """A checkpoint is missing or unusable; the message names the path and the fix."""
