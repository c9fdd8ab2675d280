"""The exceptions graphtrain raises on purpose.

The CLI turns a `UsageError` into exit code 2 and any other `GraphtrainError` into exit code 1,
printing only the message: these are the user's problems to fix, not tracebacks to read.
"""


class GraphtrainError(Exception):
    """A failure graphtrain explains in one message."""


class UsageError(GraphtrainError):
    """Bad options or bad input files: nothing was trained."""


class DataError(UsageError):
    """A dataset file is missing, truncated, corrupted or not what its name says."""


class TrainingError(GraphtrainError):
    """Training started and could not go on (a NaN loss, say)."""


class GpuUnavailableError(GraphtrainError):
    """No GPU, no driver, or a CUDA library is missing: says which and how to get it."""
