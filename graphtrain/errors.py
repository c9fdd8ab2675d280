"""The exceptions graphtrain raises on purpose, and what installs a missing piece.

One exit-code rule: what the user can fix before anything runs is a `UsageError`, exit code 2
(bad options or input files, and a `MissingRequirement`: no GPU or driver, a CUDA library or the
bindings, a framework, CUPTI or matplotlib not installed); a failure once the work has started
(a NaN loss, a failed download, a full disk) is any other `GraphtrainError`, exit code 1. The
CLI prints only the message for both: explained failures, not tracebacks to read. A bug (an
internal invariant broken) is none of these: it surfaces with its traceback.
"""


class GraphtrainError(Exception):
    """A failure graphtrain explains in one message."""


class UsageError(GraphtrainError):
    """Bad options or bad input files: nothing was trained. The user can fix it."""


class MissingRequirement(UsageError):
    """Something the command needs is not on this machine (a GPU, its driver, a CUDA library or
    the bindings, a framework, CUPTI, matplotlib); the message says what installs it."""


class ModelUnsupported(UsageError):
    """A rung that cannot train this model by its design (a persistent kernel and an MLP, say):
    `run` exits 2 with the reason; a ladder shows the row as skipped, its table still complete."""


class DataError(UsageError):
    """A dataset file is missing, truncated, corrupted or not what its name says."""


class DownloadError(GraphtrainError):
    """A dataset could not be fetched: no network, or no mirror served a good copy. `summary`:
    why, in a line, for messages that go on to say what to do instead."""

    def __init__(self, message: str, summary: str | None = None):
        super().__init__(message)
        self.summary = summary or message


class TrainingError(GraphtrainError):
    """Training started and could not go on (a NaN loss, say)."""


class OutputError(GraphtrainError):
    """A result could not be written (a full disk, say) after the work was done."""


class GpuUnavailableError(MissingRequirement):
    """No GPU, no driver, or a CUDA library is missing: says which and how to get it."""


_CUDA_EXTRAS = "pip install 'graphtrain[cu12]' (CUDA 12 driver) or 'graphtrain[cu13]' (CUDA 13 driver)"

# What installs each optional piece, for the messages that say it is missing and `graphtrain info`.
INSTALL_HINTS = {
    "cuda_bindings": _CUDA_EXTRAS,
    "driver": "an NVIDIA GPU with its driver, and " + _CUDA_EXTRAS,
    "nvrtc": f"{_CUDA_EXTRAS}; it brings nvidia-cuda-nvrtc (CUDA 13) or nvidia-cuda-nvrtc-cu12",
    "cublas": f"{_CUDA_EXTRAS}; it brings nvidia-cublas (CUDA 13) or nvidia-cublas-cu12",
    "cublasLt": f"{_CUDA_EXTRAS}; it brings nvidia-cublas (CUDA 13) or nvidia-cublas-cu12",
    "cudnn": f"{_CUDA_EXTRAS}; it brings nvidia-cudnn-cu13 or nvidia-cudnn-cu12",
    "nccl": "pip install 'graphtrain[nccl-cu13]' (CUDA 13) or 'graphtrain[nccl-cu12]' (CUDA 12)",
    "plot": "pip install 'graphtrain[plot]'",
    "profile": "pip install 'graphtrain[profile]'",
    "torch": "pip install torch",
    "jax": "pip install 'jax[cuda13]' or 'jax[cuda12]'",
}
