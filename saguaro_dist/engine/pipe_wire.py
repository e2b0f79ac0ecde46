"""The wire format of the one-host draft's pipe (engine/draft_process.py): its message kinds, and pickles
whose large arrays travel as raw out-of-band buffers. A module of its own because the child runs draft_process as
__main__, and a reduction function pickled from there would not be found by the parent.
"""
from __future__ import annotations

import copyreg
import fcntl
import io
import os
import pickle
import struct
import time
from multiprocessing.connection import Connection

import torch


class Msg:
    """Message kinds on the pipe. Parent -> child: CALL (id, method, arg) wants a REPLY (id, ok,
    result); POST (method, arg) wants none. Child -> parent: READY (ok, detail) once, REPLY, PLANS and
    then TREES (pushed after outcomes), POST_FAILED (method, text); each of these four with the child's
    CUDA-graph capture count as it was sent, right after the kind."""
    CALL, POST, READY, REPLY, PLANS, TREES, POST_FAILED = "call", "post", "ready", "reply", "plans", "trees", "post_failed"


F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux; Python < 3.10 lacks the name
PIPE_BYTES = 1 << 20
INBAND_BYTES = 1 << 16  # smaller arrays travel inside the pickle (see send)


def _tensor_as_array(t: torch.Tensor):
    """Pickle CPU tensors as numpy arrays: torch's own reduction serialises each storage like
    torch.save (a tree batch of 8 x 12 branches: 60 ms to pickle and unpickle, 12 ms this way)."""
    if t.device.type != "cpu" or t.dtype not in _NUMPY_DTYPES or t.requires_grad:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return torch.from_numpy, (t.contiguous().numpy(),)


_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool}


_DISPATCH = {**copyreg.dispatch_table, torch.Tensor: _tensor_as_array}


def send(conn: Connection, *msg) -> None:
    """A pickle header, then each large array's bytes straight from its memory (protocol 5
    out-of-band buffers: a b = 8 tree batch at T > 0 carries ~6 MB of q, copied once instead of three
    times). Arrays under INBAND_BYTES go inside the pickle: a greedy tree is a dozen 32-byte token
    rows, and a pipe write and read each would cost more than the copy. Not Connection.send: its
    ForkingPickler would move tensors through shared-memory fds."""
    head, views = _encode(msg)
    conn.send_bytes(head)
    for view in views:
        conn.send_bytes(view)


def _encode(msg: tuple) -> tuple[bytes, list[memoryview]]:
    """The header (the arrays' count and sizes, then the pickle) and the out-of-band arrays."""
    header, buffers = io.BytesIO(), []
    pickler = pickle.Pickler(header, protocol=5, buffer_callback=_out_of_band(buffers))
    pickler.dispatch_table = _DISPATCH
    pickler.dump(msg)
    views = [b.raw() for b in buffers]
    return struct.pack(f"<I{len(views)}Q", len(views), *(v.nbytes for v in views)) + header.getbuffer(), views


def framed(*msg) -> list:
    """send's message as the chunks it writes, each part framed as Connection.send_bytes frames it (recv
    reads them), for a writer on a non-blocking pipe (write_some)."""
    head, views = _encode(msg)
    chunks = []
    for part in (head, *views):
        size = len(part)
        chunks += [struct.pack("!i", size) if size <= 0x7FFFFFFF else struct.pack("!iQ", -1, size), part]
    return chunks


IOV_MAX = 512  # writev's chunks a call (POSIX guarantees 16, Linux takes 1024: a message of many arrays)


def write_some(fd: int, chunks: list) -> bool:
    """Write chunks to the non-blocking fd until all are written (True) or the pipe is full (False: the
    rest stays in chunks). One writev a message while the pipe has room."""
    while chunks:
        try:
            written = os.writev(fd, chunks[:IOV_MAX])
        except BlockingIOError:
            return False
        while chunks and written >= len(chunks[0]):
            written -= len(chunks[0])
            chunks.pop(0)
        if written:
            chunks[0] = memoryview(chunks[0])[written:]
    return True


def _out_of_band(buffers: list):
    """pickle's buffer_callback: a true return keeps the buffer in-band."""
    def keep_small_in_band(buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes < INBAND_BYTES:
            return True
        buffers.append(buffer)
        return False
    return keep_small_in_band


def recv(conn: Connection) -> tuple:
    data = conn.recv_bytes()
    (count,) = struct.unpack_from("<I", data)
    sizes = struct.unpack_from(f"<{count}Q", data, 4)
    buffers = [bytearray(size) for size in sizes]  # writable: tensors made from them may be written
    for buf in buffers:
        conn.recv_bytes_into(buf)
    return pickle.loads(memoryview(data)[4 + 8 * count:], buffers=buffers)


def widen(fd: int) -> None:
    """Pipes hold 64 KiB by default: a 6 MB message would take ~100 hand-offs between the processes."""
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # capped by /proc/sys/fs/pipe-max-size: the default size still works
        pass


def spin_until_readable(conn: Connection, spin_s: float) -> bool:
    """Busy-poll `conn` for up to spin_s; True once it has data (the caller then reads, blocking).

    Why: a process that blocks lets its CPU halt, and waking a halted virtual CPU is slow. Measured on
    this project's 2-vCPU VM (no guest halt polling): a pipe round trip to a child that sat blocked
    for 10 ms took 0.16 ms median, 0.46 ms p90, against 0.04 ms to a spinning child; a batch-4
    just-in-time draft over the pipe 19.8 ms against 13.9. The draft's core is its own in SSD's
    placement, so the spin costs nothing the target needed; after spin_s of silence it blocks."""
    end = time.perf_counter() + spin_s
    while time.perf_counter() < end:
        if conn.poll(0):
            return True
    return False
