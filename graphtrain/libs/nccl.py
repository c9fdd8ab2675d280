"""NCCL through ctypes: one communicator per process (one GPU each), an in-place sum all-reduce.

    uid = unique_id()                                   # rank 0 only; 128 bytes sent to the others
    comm = Communicator(uid, nranks, rank)              # every rank, its GPU current
    comm.all_reduce_sum(ptr, count, FLOAT32, stream)    # may be captured into a CUDA Graph

libnccl.so.2 is found by cuda.pathfinder (the nvidia-nccl-cu13 / -cu12 wheels, or NCCL_HOME).
Every ncclResult_t is checked: an `NcclError` names the call and the status, with NCCL's own
words for it (ncclGetErrorString) and, where the communicator has one, its last error message.

NVLink multicast (NVLS) stays off in every process that loads NCCL: `load()` sets
NCCL_NVLS_ENABLE=0 before the library is opened (NCCL reads it when a communicator is made), since
multicast objects can take a shared host's GPUs out of service for everyone on it.
"""

from __future__ import annotations

import ctypes
import os

from graphtrain.libs.shared_lib import LibraryError, SharedLibrary

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES

# ncclResult_t, ncclDataType_t and ncclRedOp_t, from nccl.h.
RESULTS = ("ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError", "ncclInvalidArgument",
           "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress")
FLOAT32, FLOAT64 = 7, 8
SUM = 0
ELEMENT_BYTES = {FLOAT32: 4, FLOAT64: 8}

NVLS_VARIABLE = "NCCL_NVLS_ENABLE"


def disable_nvls() -> None:
    """NVLink multicast off for this process and the ones it starts (before NCCL is loaded)."""
    os.environ[NVLS_VARIABLE] = "0"


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class NcclError(LibraryError):
    """An NCCL call returned an error status."""


class _Nccl(SharedLibrary):
    def load(self) -> ctypes.CDLL:
        disable_nvls()
        return super().load()

    def status_name(self, status: int) -> str:
        name = RESULTS[status] if 0 <= status < len(RESULTS) else f"ncclResult_t {status}"
        text = self.load().ncclGetErrorString(int(status))
        return f"{name}: {text.decode(errors='replace')}" if text else name

    def check(self, status: int, call: str, comm: ctypes.c_void_p | None = None) -> None:
        if status:
            name = self.status_name(status)
            if comm is not None and comm.value:
                last = self.load().ncclGetLastError(comm)
                if last:
                    name += f" ({last.decode(errors='replace').strip()})"
            raise NcclError(call, status, name)


_int, _ptr, _size = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
library = _Nccl("nccl", "NCCL (libnccl)", {
    "ncclGetErrorString": ([_int], ctypes.c_char_p),
    "ncclGetLastError": ([_ptr], ctypes.c_char_p),
    "ncclGetVersion": ([ctypes.POINTER(_int)], _int),
    "ncclGetUniqueId": ([ctypes.POINTER(UniqueId)], _int),
    # comm*, nranks, commId (by value), rank
    "ncclCommInitRank": ([ctypes.POINTER(_ptr), _int, UniqueId, _int], _int),
    "ncclCommFinalize": ([_ptr], _int),
    "ncclCommDestroy": ([_ptr], _int),
    "ncclCommAbort": ([_ptr], _int),
    "ncclCommGetAsyncError": ([_ptr, ctypes.POINTER(_int)], _int),
    # sendbuff, recvbuff, count, datatype, op, comm, stream
    "ncclAllReduce": ([_ptr, _ptr, _size, _int, _int, _ptr, _ptr], _int),
}, status_name="ncclGetErrorString")


def version() -> str:
    """NCCL's version ("2.28.3"): NCCL_VERSION_CODE is major·10000 + minor·100 + patch."""
    code = ctypes.c_int()
    library.check(library.load().ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
    major, rest = divmod(code.value, 10000)
    return f"{major}.{rest // 100}.{rest % 100}"


def unique_id() -> bytes:
    """A new communicator's id (made by one rank, handed to every other before they join)."""
    uid = UniqueId()
    library.check(library.load().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


class Communicator:
    """This process's rank of an `nranks` communicator on the current GPU (ncclCommInitRank: it
    returns once every rank has joined)."""

    def __init__(self, uid: bytes, nranks: int, rank: int):
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, not {len(uid)}")
        if not 0 <= rank < nranks:
            raise ValueError(f"rank {rank} is not one of the communicator's {nranks}")
        self._lib = lib = library.load()
        self.nranks, self.rank = nranks, rank
        handle, commid = ctypes.c_void_p(), UniqueId()
        ctypes.memmove(ctypes.addressof(commid), uid, UNIQUE_ID_BYTES)
        library.check(lib.ncclCommInitRank(ctypes.byref(handle), nranks, commid, rank), "ncclCommInitRank")
        self._comm: ctypes.c_void_p | None = handle

    def _require(self) -> ctypes.c_void_p:
        if self._comm is None:
            from graphtrain.libs.cuda import ClosedError

            raise ClosedError("this NCCL communicator was closed")
        return self._comm

    def all_reduce_sum(self, ptr: int, count: int, datatype: int, stream) -> None:
        """Queue, on `stream`, buffer[i] = Σ over the ranks of their buffer[i], i < count, in
        place. Inside a stream capture the all-reduce becomes a node of the graph (every rank
        must capture it, and replay the graph, in the same order)."""
        comm = self._require()
        if datatype not in ELEMENT_BYTES:
            raise ValueError(f"unsupported NCCL data type {datatype}")
        status = self._lib.ncclAllReduce(int(ptr), int(ptr), int(count), datatype, SUM, comm, int(stream.handle))
        if status:
            library.check(status, "ncclAllReduce", comm)

    def async_error(self) -> None:
        """Raise what failed on the communicator since (a peer gone, a network error), if anything."""
        comm, status = self._require(), ctypes.c_int()
        library.check(self._lib.ncclCommGetAsyncError(comm, ctypes.byref(status)), "ncclCommGetAsyncError", comm)
        library.check(status.value, "NCCL communicator (asynchronous error)", comm)

    def close(self) -> None:
        """Finalize (its queued operations complete) and destroy the communicator (idempotent)."""
        if self._comm is None:
            return
        comm, self._comm = self._comm, None
        try:
            library.check(self._lib.ncclCommFinalize(comm), "ncclCommFinalize", comm)
        finally:
            library.check(self._lib.ncclCommDestroy(comm), "ncclCommDestroy")

    def abort(self) -> None:
        """Tear the communicator down without waiting for its peers (after a failure)."""
        if self._comm is not None:
            comm, self._comm = self._comm, None
            library.check(self._lib.ncclCommAbort(comm), "ncclCommAbort")

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.abort()
