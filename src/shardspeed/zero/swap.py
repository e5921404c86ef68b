"""Swapping optimizer states to NVMe files with a thread pool, so no compiled extension is needed.

ZeRO-Infinity keeps the fp32 master shards and Adam's moments in files under
``zero_optimization.offload_optimizer.nvme_path`` and streams them through a few staging buffers one
``sub_group_size`` piece at a time: the next piece is read while this one is updated, and the last one
is written while the next is updated. DeepSpeed does the I/O with libaio through a compiled extension.
Here it is done by threads calling ``os.preadv``/``os.pwritev`` on large aligned requests: those
calls release the GIL, so a few threads keep a device as busy as an asynchronous submission queue does.

How each ``aio`` option is honoured (see :class:`AioOptions`):

* ``block_size``: every transfer is cut into requests of this many bytes; each file is padded to a
  multiple of it.
* ``thread_count`` (DeepSpeed's ``intra_op_parallelism``) and ``queue_depth``: libaio keeps
  ``queue_depth`` requests in flight on each of ``intra_op_parallelism`` threads. A thread in
  ``preadv`` has exactly one request in flight, so the pool has ``thread_count * queue_depth`` threads,
  which is the same number of requests in flight at the device. One transfer's requests spread over all
  of them.
* ``single_submit``: requests are handed to the pool one at a time (one wake-up each) instead of as a
  batch. This is what it means in libaio too; it is not expected to change throughput.
* ``overlap_events``: when true, a pool thread takes the next request as soon as its last one is done.
  When false, a transfer goes in waves: the next ``thread_count * queue_depth`` requests are handed out
  only once the whole previous wave has completed (libaio's submit-then-reap lockstep). Either way
  :meth:`NvmeSwapper.read` and :meth:`NvmeSwapper.write` return a future at once.
* ``use_direct``: open files with ``O_DIRECT`` so swapped states do not fill the page cache (the memory
  the offload was meant to save). When the filesystem refuses it, one message is logged and buffered
  I/O is used; a block is written and read back first, so that mode is checked too.

With ``O_DIRECT`` a piece whose address or length is not 4096-aligned (a tensor not made by
:func:`aligned_empty`, or the odd tail of any tensor) goes through a per-thread aligned bounce buffer
of at most one block; the file's padding makes room for the whole aligned tail.

The files are scratch: they are never fsynced (a crash loses the run's optimizer states anyway, and
checkpoints are written elsewhere) and are removed when the swapper closes. Only a process killed
outright (SIGKILL, OOM killer) leaves its ``shardspeed-<host>-<pid>-*`` directory behind.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

import torch

logger = logging.getLogger("shardspeed")

# O_DIRECT wants buffer addresses, file offsets and lengths aligned to the device's logical block
# size; 4096 covers every common device (512-byte and 4K sectors).
_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

# Paths whose O_DIRECT refusal was already logged, so a process logs it once per path.
_warned_paths: set[str] = set()
_warned_lock = threading.Lock()


class SwapError(OSError):
    """An NVMe swap path could not be used or an I/O on it failed; the message names the path."""


@dataclass(frozen=True)
class AioOptions:
    """DeepSpeed's ``aio`` section, as honoured by a thread pool (see the module docstring)."""

    block_size: int = 1048576
    queue_depth: int = 8
    thread_count: int = 1  # DeepSpeed's ``intra_op_parallelism``
    single_submit: bool = False
    overlap_events: bool = True
    use_direct: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "thread_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"aio.{name} must be a positive integer, got {value!r}")
        if self.block_size % _ALIGN:
            # Every request starts at a multiple of block_size, which O_DIRECT needs aligned.
            raise ValueError(
                f"aio.block_size must be a multiple of {_ALIGN}, got {self.block_size}"
            )
        for name in ("single_submit", "overlap_events", "use_direct"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"aio.{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def requests_in_flight(self) -> int:
        """Pool threads, hence requests at the device at once: libaio's threads times queue depth."""
        return self.thread_count * self.queue_depth


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def aligned_empty(
    numel: int, dtype: torch.dtype, alignment: int = _ALIGN, pin: bool = False
) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data pointer is `alignment`-aligned.

    Its storage runs on to the next multiple of `alignment` bytes, so the buffer is usable for
    ``O_DIRECT`` without a bounce copy (the swapper still never reads or writes past `numel`
    elements, since it cannot know that arbitrary tensors have such room). With `pin` and CUDA
    available the memory is page-locked, so copies to and from the GPU can be asynchronous; without
    CUDA `pin` is ignored, since there is nothing to pin for.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative integer, got {numel!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if alignment < itemsize or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= {itemsize}, got {alignment}")
    nbytes = max(_round_up(numel * itemsize, alignment), alignment)
    pin = pin and torch.cuda.is_available()
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin)
    shift = -raw.data_ptr() % alignment
    return raw[shift : shift + nbytes].view(dtype)[:numel]


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable, zero-copy view of a contiguous CPU tensor's bytes."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _filesystem_of(path: str) -> str:
    """The type and mount point of the filesystem holding `path`, for messages (Linux only)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown filesystem"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, f"{fields[2]} mounted at {mount}"
    except OSError:
        pass
    return kind


def _error(exc: OSError, what: str, path: str) -> SwapError:
    """`exc` as a SwapError naming `path` and saying what was being done."""
    code = exc.errno if exc.errno is not None else errno.EIO
    return SwapError(code, f"{what}: {exc.strerror or exc}", path)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwritev(fd, [data[done:]], offset + done)


def _pread_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, "unexpected end of swap file")
        done += n


def _open(path: str, flags: int) -> int:
    """``os.open`` with close-on-exec; one place for tests to make a filesystem refuse O_DIRECT."""
    return os.open(path, flags | _O_CLOEXEC, 0o600)


@dataclass
class _Region:
    """One key's file: `nbytes` of data, padded to `padded` on disk."""

    path: str
    nbytes: int
    padded: int
    written: bool = False  # a write was submitted
    failed: bool = False  # the last finished write failed, so the file's contents are not the data


class _Op:
    """One read or write of a key: its requests, its progress, and the future the caller holds."""

    __slots__ = (
        "active",
        "address",
        "error",
        "fd",
        "future",
        "keep",
        "key",
        "next",
        "region",
        "requests",
        "successor",
        "view",
        "write",
    )

    def __init__(
        self, write: bool, key: str, region: _Region, tensor: torch.Tensor, block: int
    ) -> None:
        self.write = write
        self.key = key
        self.region = region
        # Both keep the tensor's memory alive until the I/O is done; dropped once it is.
        self.keep: torch.Tensor | None = tensor
        self.view: memoryview | None = _byte_view(tensor)
        self.address = tensor.data_ptr()
        n = region.nbytes
        self.requests = [(off, min(block, n - off)) for off in range(0, n, block)]
        self.next = 0  # index of the first request not yet handed to the pool
        self.active = 0  # requests handed to the pool and not finished
        self.fd = -1
        self.error: BaseException | None = None
        self.successor: _Op | None = None  # the next op on the same key, started when this ends
        self.future: Future = Future()


class _Engine:
    """The pool and its bookkeeping, apart from the swapper so that threads never keep it alive."""

    def __init__(self, options: AioOptions, direct: bool) -> None:
        self.options = options
        self.direct = direct
        # One lock, two conditions: a wake-up meant for a pool thread must never be taken by a
        # caller in wait_all (and lost), or a queued request could sit with every thread asleep.
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)  # pool threads wait here for requests
        self.settled = threading.Condition(self.lock)  # wait_all waits here for ops to finish
        self.queue: collections.deque[tuple[_Op, int, int]] = collections.deque()
        self.tail: dict[str, _Op] = {}  # the last op submitted on each key, until it finishes
        self.outstanding = 0  # ops submitted and not finished
        self.errors: list[BaseException] = []  # failures not yet raised by wait_all
        self.stopping = False
        self.local = threading.local()  # each thread's bounce buffer
        # Threads are started as requests queue up, up to requests_in_flight: a swapper that is
        # mostly idle, or has a tuned queue depth of hundreds, does not hold hundreds of threads.
        # They are daemons, so a swapper nobody closed cannot hold the interpreter open at exit.
        self.threads: list[threading.Thread] = []
        self.idle = 0  # threads waiting for a request
        self.pid = os.getpid()

    # Submission ------------------------------------------------------------------------------

    def submit(self, op: _Op) -> None:
        """Start `op`, or queue it behind the unfinished op on the same key (reads see prior writes)."""
        with self.lock:
            if self.stopping:
                raise ValueError("the swapper is closed")
            self.outstanding += 1
            prev = self.tail.get(op.key)
            self.tail[op.key] = op
            if prev is not None:
                prev.successor = op
                return
        self._start(op)

    def _start(self, op: _Op) -> None:
        region = op.region
        try:
            if not op.write and region.failed:
                raise SwapError(errno.EIO, f"an earlier write of {op.key!r} failed", region.path)
            if op.requests:
                flags = os.O_WRONLY if op.write else os.O_RDONLY
                op.fd = _open(region.path, flags | (_O_DIRECT if self.direct else 0))
        except OSError as exc:
            what = "write" if op.write else "read"
            err = (
                exc
                if isinstance(exc, SwapError)
                else _error(exc, f"{what} of {op.key!r}", region.path)
            )
            self._finish(op, err)
            return
        with self.lock:
            if self.stopping:
                self._cancel(op)
            else:
                self._feed(op)
            done = op.active == 0
        if done:
            self._finish(op, op.error)

    def _cancel(self, op: _Op) -> None:
        """Hand out no more of `op`; it fails unless everything was already done. Lock held."""
        if op.next < len(op.requests) and op.error is None:
            op.error = SwapError(errno.ECANCELED, "the swapper was closed first", op.region.path)
        op.next = len(op.requests)

    def _feed(self, op: _Op) -> None:
        """Hand `op`'s next requests to the pool (all of them, or one wave); caller holds the lock."""
        if self.options.overlap_events:
            stop = len(op.requests)
        elif op.active == 0:
            stop = min(len(op.requests), op.next + self.options.requests_in_flight)
        else:
            return
        batch = [(op, off, length) for off, length in op.requests[op.next : stop]]
        op.next = stop
        op.active += len(batch)
        if self.options.single_submit:
            for request in batch:
                self.queue.append(request)
                self.work.notify()
        elif batch:
            self.queue.extend(batch)
            self.work.notify(len(batch))
        wanted = len(self.queue) - self.idle
        while wanted > 0 and len(self.threads) < self.options.requests_in_flight:
            name = f"shardspeed-swap-{len(self.threads)}"
            thread = threading.Thread(target=self._work, name=name, daemon=True)
            thread.start()
            self.threads.append(thread)
            wanted -= 1

    # The pool -------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self.lock:
                while not self.queue and not self.stopping:
                    self.idle += 1
                    self.work.wait()
                    self.idle -= 1
                if not self.queue:
                    return
                op, offset, length = self.queue.popleft()
            err: BaseException | None = None
            if op.error is None:  # the rest of a failed op is skipped
                try:
                    self._transfer(op, offset, length)
                except OSError as exc:
                    what = "write" if op.write else "read"
                    err = _error(exc, f"{what} of {op.key!r} at byte {offset}", op.region.path)
                except BaseException as exc:
                    err = exc
            self._request_done(op, err)

    def _transfer(self, op: _Op, offset: int, length: int) -> None:
        data = op.view[offset : offset + length]
        if self.direct and ((op.address + offset) % _ALIGN or length % _ALIGN):
            # O_DIRECT cannot take this piece as is (an odd tail, or a tensor not from
            # aligned_empty): go through an aligned buffer; the file is padded so this fits.
            padded = _round_up(length, _ALIGN)
            bounce = self._bounce(padded)
            if op.write:
                bounce[:length] = data
                bounce[length:padded] = bytes(padded - length)
                _pwrite_all(op.fd, bounce, offset)
            else:
                _pread_all(op.fd, bounce, offset)
                data[:] = bounce[:length]
        elif op.write:
            _pwrite_all(op.fd, data, offset)
        else:
            _pread_all(op.fd, data, offset)

    def _bounce(self, nbytes: int) -> memoryview:
        """This thread's aligned buffer, at least `nbytes` long (at most one block)."""
        held = getattr(self.local, "buffer", None)
        if held is None or len(held[1]) < nbytes:
            tensor = aligned_empty(nbytes, torch.uint8)
            held = (tensor, _byte_view(tensor))
            self.local.buffer = held
        return held[1][:nbytes]

    def _request_done(self, op: _Op, err: BaseException | None) -> None:
        with self.lock:
            op.active -= 1
            if err is not None and op.error is None:
                op.error = err
            if op.error is not None or self.stopping:
                self._cancel(op)
            else:
                self._feed(op)
            done = op.active == 0 and op.next == len(op.requests)
        if done:
            self._finish(op, op.error)

    def _finish(self, op: _Op, err: BaseException | None) -> None:
        if op.fd >= 0:
            try:
                os.close(op.fd)
            except OSError as exc:
                err = err or _error(exc, f"closing {op.key!r}", op.region.path)
            op.fd = -1
        if op.write:
            op.region.failed = err is not None
        if err is None:
            op.future.set_result(op.keep)
        else:
            op.future.set_exception(err)
        op.keep = op.view = None
        with self.lock:
            if err is not None:
                self.errors.append(err)
            if self.tail.get(op.key) is op:
                del self.tail[op.key]
            successor = op.successor
            self.outstanding -= 1
            self.settled.notify_all()
        if successor is not None:
            self._start(successor)

    # Waiting and stopping ------------------------------------------------------------------

    def wait_all(self) -> None:
        with self.lock:
            while self.outstanding:
                self.settled.wait()
            errors, self.errors = self.errors, []
        if errors:
            raise errors[0]

    def shutdown(self, top: str) -> None:
        """Cancel queued requests, let running ones end, stop the threads and delete `top`."""
        if os.getpid() != self.pid:
            # A forked child (a data loader worker, say) inherits this object and its finalizer:
            # its exit or garbage collection must not delete the parent's files, nor wait on a
            # lock a parent thread may have held at the fork.
            return
        with self.lock:
            self.stopping = True
            dropped = list(self.queue)
            self.queue.clear()
            self.work.notify_all()
            threads = list(self.threads)
        for op, offset, _ in dropped:
            cancelled = SwapError(
                errno.ECANCELED, f"the swapper was closed before byte {offset}", op.region.path
            )
            self._request_done(op, cancelled)
        me = threading.current_thread()
        for thread in threads:
            if thread is not me:
                thread.join()
        shutil.rmtree(top, ignore_errors=True)
        if os.path.exists(top):
            logger.warning("could not remove the NVMe swap directory %s", top)


class NvmeSwapper:
    """Keeps named byte regions in files of a private directory under `nvme_path` (one per swapper).

    The directory is ``nvme_path/shardspeed-<host>-<pid>-<random>/rank<R>/``, so jobs and ranks
    sharing a path never touch each other's files. It is removed by :meth:`close`, on leaving a
    ``with`` block (also by an exception), when the swapper is garbage-collected and at interpreter
    exit. The path must already exist: it is checked by writing and reading back one block, and any
    failure raises :class:`SwapError` naming it; there is no fallback to another place.

    :meth:`write` and :meth:`read` return futures at once. Operations on one key run in the order
    submitted (a read sees every write submitted before it); those on different keys overlap. The
    caller must leave a tensor alone until its future is done.
    """

    def __init__(self, nvme_path: str | os.PathLike[str], rank: int, options: AioOptions) -> None:
        self.options = options
        self.nvme_path = os.path.abspath(os.fspath(nvme_path))
        if not os.path.isdir(self.nvme_path):
            code = errno.ENOTDIR if os.path.exists(self.nvme_path) else errno.ENOENT
            raise SwapError(code, "NVMe swap path is not an existing directory", self.nvme_path)
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
        while True:
            name = f"shardspeed-{host}-{os.getpid()}-{secrets.token_hex(4)}"
            top = os.path.join(self.nvme_path, name)
            try:
                os.mkdir(top, 0o700)
                break
            except FileExistsError:
                continue
            except OSError as exc:
                raise _error(exc, "cannot create a swap directory in", self.nvme_path) from exc
        self._top = top
        self.directory = os.path.join(top, f"rank{rank}")
        try:
            try:
                os.mkdir(self.directory, 0o700)
            except OSError as exc:
                raise _error(exc, "cannot create a swap directory in", self.nvme_path) from exc
            direct = self._probe(options.use_direct and bool(_O_DIRECT))
        except BaseException:
            shutil.rmtree(top, ignore_errors=True)
            raise
        self.direct = direct
        self._regions: dict[str, _Region] = {}
        self._serial = itertools.count()  # file names stay unique even if a key's reserve fails
        self._lock = threading.Lock()
        self._engine = _Engine(options, direct)
        self._closed = False
        # Also runs at interpreter exit; it holds the engine and the path, never the swapper.
        self._finalizer = weakref.finalize(self, _Engine.shutdown, self._engine, top)

    def _probe(self, direct: bool) -> bool:
        """Write and read back one block; return whether O_DIRECT works here."""
        path = os.path.join(self.directory, "probe")
        if direct:
            try:
                self._roundtrip(path, _O_DIRECT)
                return True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise _error(exc, "NVMe swap path is not usable", self.nvme_path) from exc
            with _warned_lock:
                first = self.nvme_path not in _warned_paths
                _warned_paths.add(self.nvme_path)
            if first:
                logger.warning(
                    "NVMe swap path %s (%s) refuses O_DIRECT; using buffered I/O there, so swapped "
                    "optimizer states also pass through the page cache",
                    self.nvme_path,
                    _filesystem_of(self.nvme_path),
                )
        elif self.options.use_direct and not _O_DIRECT:
            logger.warning(
                "this OS has no O_DIRECT; NVMe swap at %s uses buffered I/O", self.nvme_path
            )
        try:
            self._roundtrip(path, 0)
        except OSError as exc:
            raise _error(exc, "NVMe swap path is not usable", self.nvme_path) from exc
        return False

    def _roundtrip(self, path: str, flags: int) -> None:
        size = self.options.block_size
        out = aligned_empty(size, torch.uint8)
        _byte_view(out)[:] = os.urandom(size)  # not torch's generator: leave training's RNG alone
        back = aligned_empty(size, torch.uint8)
        back.zero_()
        fd = _open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flags)
        try:
            _pwrite_all(fd, _byte_view(out), 0)
            _pread_all(fd, _byte_view(back), 0)
        finally:
            os.close(fd)
            os.unlink(path)
        if not torch.equal(out, back):
            raise SwapError(errno.EIO, "a block written to the swap path read back different", path)

    # Space -------------------------------------------------------------------------------------

    def padded_size(self, nbytes: int) -> int:
        """Bytes a region of `nbytes` takes on disk (files are padded to whole blocks)."""
        return _round_up(nbytes, self.options.block_size)

    def check_space(self, total_bytes: int) -> None:
        """Raise SwapError naming the path if `total_bytes` more would not fit on its filesystem.

        Count regions with :meth:`padded_size`. Called before training, so a full disk is found
        before hours of work rather than at the first swap.
        """
        free = shutil.disk_usage(self.directory).free
        if total_bytes > free:
            raise SwapError(
                errno.ENOSPC,
                f"NVMe swap needs {total_bytes} bytes but its filesystem has {free} free",
                self.nvme_path,
            )

    def reserve(self, key: str, nbytes: int) -> None:
        """Create `key`'s file, `nbytes` padded to whole blocks, with its space allocated now.

        ``posix_fallocate`` makes a full disk show up here, naming the file, rather than as a failed
        write mid-training; filesystems without it get a sparse file.
        """
        self._check_open()
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative integer, got {nbytes!r}")
        padded = self.padded_size(nbytes)
        with self._lock:
            if key in self._regions:
                raise ValueError(f"swap key {key!r} is already reserved")
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:80]
            path = os.path.join(self.directory, f"{next(self._serial):06d}-{safe}.swp")
            self._regions[key] = _Region(path, nbytes, padded)
        try:
            free = shutil.disk_usage(self.directory).free
            if padded > free:  # not even trying spares the disk a fill-up that other jobs would see
                raise SwapError(
                    errno.ENOSPC, f"reserving {padded} bytes with {free} free for {key!r}", path
                )
            fd = _open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)  # buffered: glibc may emulate
            try:
                if padded:
                    try:
                        os.posix_fallocate(fd, 0, padded)
                    except OSError as exc:
                        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                            raise
                        os.ftruncate(fd, padded)
            finally:
                os.close(fd)
        except BaseException as exc:
            with self._lock:
                del self._regions[key]
            if os.path.exists(path):
                os.unlink(path)
            if isinstance(exc, OSError) and not isinstance(exc, SwapError):
                raise _error(exc, f"reserving {padded} bytes for {key!r}", path) from exc
            raise

    def bytes_on_disk(self) -> int:
        """Bytes reserved in this swapper's files, padding included (for memory accounting)."""
        with self._lock:
            return sum(region.padded for region in self._regions.values())

    # I/O ---------------------------------------------------------------------------------------

    def write(self, key: str, tensor: torch.Tensor) -> Future:
        """Start writing `tensor` (contiguous, CPU, exactly the key's size) to `key`'s file.

        The future's result is `tensor`. Tensors from :func:`aligned_empty` avoid a bounce copy.
        """
        region = self._region(key, tensor, "write")
        region.written = True
        return self._submit(_Op(True, key, region, tensor, self.options.block_size))

    def read(self, key: str, out_tensor: torch.Tensor) -> Future:
        """Start reading `key` into `out_tensor` (contiguous, CPU, the key's size); result: it."""
        region = self._region(key, out_tensor, "read")
        if not region.written:
            raise ValueError(f"swap key {key!r} was never written")
        return self._submit(_Op(False, key, region, out_tensor, self.options.block_size))

    def wait_all(self) -> None:
        """Wait for every submitted read and write; raise the first failure not yet raised here."""
        self._engine.wait_all()

    def _region(self, key: str, tensor: torch.Tensor, what: str) -> _Region:
        self._check_open()
        with self._lock:
            region = self._regions.get(key)
        if region is None:
            raise KeyError(f"swap key {key!r} was never reserved")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"can only {what} contiguous CPU tensors, got {tensor.device} one")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != region.nbytes:
            raise ValueError(f"swap key {key!r} holds {region.nbytes} bytes, the tensor {nbytes}")
        return region

    def _submit(self, op: _Op) -> Future:
        self._engine.submit(op)
        return op.future

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the swapper is closed")

    # Lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for all I/O, stop the threads and delete this swapper's directory (idempotent).

        A failed I/O is raised after the files are gone.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._engine.wait_all()
        finally:
            self._finalizer()

    def __enter__(self) -> NvmeSwapper:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not hide the exception behind an I/O failure; the files still go
            self._closed = True
            self._finalizer()

    def __repr__(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        return f"NvmeSwapper({self.directory!r}, {mode}, {len(self._regions)} keys)"
