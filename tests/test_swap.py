"""The NVMe swapper: exact round trips, ordering, private directories, clean-up and loud failures."""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from shardspeed.zero import swap
from shardspeed.zero.swap import AioOptions, NvmeSwapper, SwapError, aligned_empty

SMALL = AioOptions(block_size=8192, queue_depth=2, thread_count=2)  # many requests per tensor


@pytest.fixture(params=["disk", "shm"])
def root(request, tmp_path):
    """A directory on the test disk, and one on /dev/shm (tmpfs) where present."""
    if request.param == "disk":
        yield tmp_path
        return
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    path = tempfile.mkdtemp(dir="/dev/shm", prefix="shardspeed-test-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _leftovers(path) -> list[str]:
    return [name for name in os.listdir(path) if name.startswith("shardspeed-")]


def test_aligned_empty_is_aligned_with_room_to_an_aligned_end():
    for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.float64):
        for numel in (0, 1, 1023, 4096, 100_003):
            t = aligned_empty(numel, dtype)
            assert t.shape == (numel,) and t.dtype == dtype and t.device.type == "cpu"
            assert t.data_ptr() % 4096 == 0
            room = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
            assert room >= -(-numel * t.element_size() // 4096) * 4096
    assert aligned_empty(10, torch.float32, alignment=512).data_ptr() % 512 == 0
    t = aligned_empty(10, torch.float32, pin=True)  # pinned only where CUDA is; fine either way
    assert t.data_ptr() % 4096 == 0
    with pytest.raises(ValueError):
        aligned_empty(10, torch.float32, alignment=3000)
    with pytest.raises(ValueError):
        aligned_empty(-1, torch.float32)


def test_aio_options_are_checked():
    assert AioOptions().requests_in_flight == 8
    assert AioOptions(thread_count=2, queue_depth=4).requests_in_flight == 8
    for bad in (
        {"block_size": 1000},
        {"block_size": 0},
        {"queue_depth": 0},
        {"thread_count": True},
        {"single_submit": 1},
        {"use_direct": "yes"},
    ):
        with pytest.raises(ValueError):
            AioOptions(**bad)


@pytest.mark.parametrize(
    "options",
    [
        AioOptions(),
        SMALL,
        AioOptions(block_size=8192, queue_depth=3, overlap_events=False),
        AioOptions(block_size=8192, single_submit=True),
        AioOptions(block_size=8192, use_direct=False),
    ],
    ids=["default", "small-blocks", "no-overlap", "single-submit", "buffered"],
)
def test_round_trip_of_odd_sizes_with_concurrent_io(root, options):
    sizes = [1, 1023, 2049, 4097, 300_001, 1_000_003]
    with NvmeSwapper(root, 0, options) as s:
        originals, outs = {}, {}
        for i, numel in enumerate(sizes):
            for dtype in (torch.float32, torch.bfloat16):
                key = f"state/{numel}/{dtype}"
                originals[key] = _random(numel, dtype, seed=i)
                outs[key] = aligned_empty(numel, dtype)
                s.reserve(key, numel * originals[key].element_size())
        writes = [s.write(key, t) for key, t in originals.items()]  # all in flight at once
        reads = [s.read(key, outs[key]) for key in originals]  # each waits for its own write
        for future in writes + reads:
            future.result(timeout=60)
        s.wait_all()
        for key, t in originals.items():
            assert torch.equal(outs[key], t), key
        # Tensors that are not aligned at all (a slice one element into a buffer) also round-trip,
        # through the bounce buffer, and the bytes next to them are left alone.
        big = torch.zeros(1_000_003 + 2)
        middle = big[1:-1]
        assert middle.data_ptr() % 4096
        s.read("state/1000003/torch.float32", middle).result(timeout=60)
        assert torch.equal(middle, originals["state/1000003/torch.float32"])
        assert big[0] == 0 and big[-1] == 0
        middle.mul_(2)
        s.write("state/1000003/torch.float32", middle)
        back = aligned_empty(1_000_003, torch.float32)
        s.read("state/1000003/torch.float32", back).result(timeout=60)
        assert torch.equal(back, originals["state/1000003/torch.float32"] * 2)
        files = os.listdir(s.directory)
        assert len(files) == len(originals)
        for name in files:  # every file is whole blocks
            assert os.path.getsize(os.path.join(s.directory, name)) % options.block_size == 0
    assert _leftovers(root) == []


def test_operations_on_one_key_run_in_submission_order(tmp_path):
    with NvmeSwapper(tmp_path, 0, SMALL) as s:
        s.reserve("k", 400_000 * 4)
        outs = [aligned_empty(400_000, torch.float32) for _ in range(4)]
        futures = []
        for i, out in enumerate(outs):  # write v_i, read it back, write v_{i+1}, ... nothing waited
            futures.append(s.write("k", torch.full((400_000,), float(i))))
            futures.append(s.read("k", out))
        for future in futures:
            future.result(timeout=60)
        for i, out in enumerate(outs):
            assert torch.equal(out, torch.full((400_000,), float(i))), i


def test_many_threads_submitting_while_another_waits(tmp_path):
    """Submitting from several threads while another sits in wait_all neither stalls nor mixes data."""
    with NvmeSwapper(tmp_path, 0, AioOptions(block_size=4096, queue_depth=2)) as s:
        stop, failures = threading.Event(), []

        def waiter():
            while not stop.is_set():
                s.wait_all()

        def submitter(n):
            try:
                key = f"t{n}"
                s.reserve(key, 1000 * 4)
                out = aligned_empty(1000, torch.float32)
                for i in range(100):  # one request each: one wake-up each
                    s.write(key, torch.full((1000,), float(i + n)))
                    s.read(key, out).result(timeout=30)
                    assert torch.equal(out, torch.full((1000,), float(i + n)))
            except BaseException as exc:
                failures.append(exc)

        background = threading.Thread(target=waiter)
        background.start()
        workers = [threading.Thread(target=submitter, args=(n,)) for n in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stop.set()
        background.join()
        assert failures == []


def test_read_ahead_and_write_behind_over_pieces(root):
    """The ZeRO pattern: update piece i while piece i+1 is read and piece i-1 is written."""
    pieces, numel = 6, 250_001
    with NvmeSwapper(root, 3, AioOptions(block_size=65536)) as s:
        expected = []
        for i in range(pieces):
            s.reserve(f"piece{i}", numel * 4)
            expected.append(_random(numel, torch.float32, seed=100 + i))
            s.write(f"piece{i}", expected[i])
        s.wait_all()
        buffers = [aligned_empty(numel, torch.float32) for _ in range(3)]
        reads = {0: s.read("piece0", buffers[0])}
        writes = {}
        for i in range(pieces):
            buffer = buffers[i % 3]
            if i + 1 < pieces:  # the buffer piece i+1 lands in was last written out for piece i-2
                if i - 2 in writes:
                    writes.pop(i - 2).result(timeout=60)
                reads[i + 1] = s.read(f"piece{i + 1}", buffers[(i + 1) % 3])
            reads.pop(i).result(timeout=60)
            assert torch.equal(buffer, expected[i])
            buffer.add_(1.0)  # the "optimizer step"
            writes[i] = s.write(f"piece{i}", buffer)
        s.wait_all()
        for i in range(pieces):
            out = aligned_empty(numel, torch.float32)
            s.read(f"piece{i}", out).result(timeout=60)
            assert torch.equal(out, expected[i] + 1.0), i


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_events_false_hands_out_requests_in_waves(tmp_path, monkeypatch, overlap):
    """Without overlap, no request of wave k+1 starts before all of wave k are done."""
    options = AioOptions(block_size=4096, queue_depth=3, overlap_events=overlap)
    events, lock = [], threading.Lock()
    transfer = swap._Engine._transfer

    def logged(self, op, offset, length):
        with lock:
            events.append(("start", offset))
        time.sleep(0.002 if offset % 3 else 0.01)  # uneven, so waves would show
        transfer(self, op, offset, length)
        with lock:
            events.append(("end", offset))

    monkeypatch.setattr(swap._Engine, "_transfer", logged)
    with NvmeSwapper(tmp_path, 0, options) as s:
        x = _random(12 * 1024 + 7, torch.float32, seed=9)  # 13 requests of a block
        s.reserve("x", x.numel() * 4)
        events.clear()  # the probe does not go through the pool, but be sure
        s.write("x", x).result(timeout=60)
        assert len(s._engine.threads) <= options.requests_in_flight
    wave = options.requests_in_flight
    position = {event: i for i, event in enumerate(events)}
    crossings = 0
    for block in range(wave, 13):
        previous = range((block // wave - 1) * wave, (block // wave) * wave)
        crossings += any(
            position[("start", block * 4096)] < position[("end", p * 4096)] for p in previous
        )
    if overlap:
        assert crossings > 0  # a free thread took the next request at once
    else:
        assert crossings == 0


def test_an_unclosed_swapper_is_removed_at_interpreter_exit(tmp_path):
    script = (
        "import sys, torch\n"
        "from shardspeed.zero.swap import AioOptions, NvmeSwapper\n"
        f"s = NvmeSwapper({str(tmp_path)!r}, 0, AioOptions())\n"
        "s.reserve('k', 1 << 22)\n"
        "s.write('k', torch.ones(1 << 20))\n"
        "print(len(__import__('os').listdir(s.directory)))\n"
        "raise SystemExit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == "1"
    assert _leftovers(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_leaves_the_parents_files_alone(tmp_path):
    with NvmeSwapper(tmp_path, 0, AioOptions()) as s:
        s.reserve("k", 4096)
        s.write("k", torch.ones(1024)).result(timeout=60)
        pid = os.fork()
        if pid == 0:  # the child runs what its exit or garbage collection would run
            try:
                s._finalizer()
            finally:
                os._exit(0)
        deadline = time.monotonic() + 60
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                pytest.fail("the forked child hung in the finalizer")
            time.sleep(0.01)
        out = aligned_empty(1024, torch.float32)
        s.read("k", out).result(timeout=60)
        assert torch.equal(out, torch.ones(1024))
    assert _leftovers(tmp_path) == []


def test_two_swappers_on_one_path_get_private_directories(tmp_path):
    a = NvmeSwapper(tmp_path, 0, AioOptions())
    b = NvmeSwapper(tmp_path, 0, AioOptions())
    c = NvmeSwapper(tmp_path, 1, AioOptions())
    try:
        dirs = {a.directory, b.directory, c.directory}
        assert len(dirs) == 3 and len(_leftovers(tmp_path)) == 3
        assert os.path.basename(c.directory) == "rank1"
        assert f"-{os.getpid()}-" in os.path.basename(os.path.dirname(a.directory))
        for s in (a, b):
            s.reserve("same-key", 4096 * 4)
        a.write("same-key", torch.ones(4096))
        b.write("same-key", torch.zeros(4096))
        out = aligned_empty(4096, torch.float32)
        a.read("same-key", out).result(timeout=60)
        assert torch.equal(out, torch.ones(4096))
    finally:
        for s in (a, b, c):
            s.close()
    assert _leftovers(tmp_path) == []


def test_close_waits_for_io_then_removes_the_files(tmp_path):
    s = NvmeSwapper(tmp_path, 0, SMALL)
    futures = []
    for i in range(8):
        s.reserve(f"k{i}", 100_000 * 4)
        futures.append(s.write(f"k{i}", torch.full((100_000,), float(i))))
    assert s.bytes_on_disk() == 8 * s.padded_size(100_000 * 4)
    s.close()
    assert all(f.done() and f.exception() is None for f in futures)
    assert _leftovers(tmp_path) == []
    s.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        s.write("k0", torch.zeros(100_000))


def test_an_exception_inside_with_removes_the_files(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), NvmeSwapper(tmp_path, 0, SMALL) as s:
        s.reserve("k", 1 << 20)
        s.write("k", torch.zeros(1 << 18))
        assert len(_leftovers(tmp_path)) == 1
        raise RuntimeError("boom")
    assert _leftovers(tmp_path) == []


def test_garbage_collection_removes_the_files_and_threads(tmp_path):
    before = threading.active_count()
    s = NvmeSwapper(tmp_path, 0, AioOptions())
    s.reserve("k", 1 << 20)
    s.write("k", torch.zeros(1 << 18)).result(timeout=60)
    assert len(_leftovers(tmp_path)) == 1
    del s
    gc.collect()
    assert _leftovers(tmp_path) == []
    assert threading.active_count() == before


def test_a_missing_path_raises_naming_it(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(SwapError, match=str(missing)) as info:
        NvmeSwapper(missing, 0, AioOptions())
    assert info.value.errno == errno.ENOENT


def test_a_path_under_a_regular_file_raises_naming_it(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    bad = tmp_path / "file" / "sub"
    with pytest.raises(SwapError, match=str(bad)):
        NvmeSwapper(bad, 0, AioOptions())
    with pytest.raises(SwapError, match=str(tmp_path / "file")) as info:
        NvmeSwapper(tmp_path / "file", 0, AioOptions())
    assert info.value.errno == errno.ENOTDIR


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores permissions")
def test_an_unwritable_directory_raises_naming_it(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(SwapError, match=str(locked)) as info:
            NvmeSwapper(locked, 0, AioOptions())
        assert info.value.errno == errno.EACCES
        assert "Permission denied" in str(info.value)
    finally:
        locked.chmod(0o700)


def test_a_directory_refusing_mkdir_raises_naming_it(tmp_path, monkeypatch):
    """What the test above checks, for runs as root, where mode 0o500 does not bite."""

    def refuse(path, mode=0o777):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(os, "mkdir", refuse)
    with pytest.raises(SwapError, match=str(tmp_path)) as info:
        NvmeSwapper(tmp_path, 0, AioOptions())
    assert info.value.errno == errno.EACCES and "Permission denied" in str(info.value)


def test_a_path_that_fails_the_write_probe_raises_naming_it(tmp_path, monkeypatch):
    """What a read-only filesystem does, which running as root cannot otherwise show."""

    def read_only(fd, data, offset):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(swap, "_pwrite_all", read_only)
    with pytest.raises(SwapError, match=str(tmp_path)) as info:
        NvmeSwapper(tmp_path, 0, AioOptions())
    assert info.value.errno == errno.EROFS
    assert os.strerror(errno.EROFS) in str(info.value)
    assert _leftovers(tmp_path) == []  # nothing left behind by the failed start


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this OS")
def test_a_filesystem_refusing_o_direct_falls_back_to_buffered_io_once(
    tmp_path, monkeypatch, caplog
):
    """Kernels before 6.6 refuse O_DIRECT on tmpfs with EINVAL; newer ones accept it."""
    real_open = swap._open

    def no_direct(path, flags):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags)

    monkeypatch.setattr(swap, "_open", no_direct)
    monkeypatch.setattr(swap, "_warned_paths", set())
    with (
        caplog.at_level(logging.WARNING, logger="shardspeed"),
        NvmeSwapper(tmp_path, 0, SMALL) as s,
        NvmeSwapper(tmp_path, 1, SMALL) as t,
    ):
        assert not s.direct and not t.direct
        x = _random(123_457, torch.bfloat16, seed=7)
        s.reserve("x", x.numel() * 2)
        s.write("x", x)
        out = aligned_empty(x.numel(), torch.bfloat16)
        s.read("x", out).result(timeout=60)
        assert torch.equal(out, x)
    messages = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(messages) == 1
    assert str(tmp_path) in messages[0] and "mounted at" in messages[0]


def test_real_tmpfs_round_trips_whichever_mode_it_allows():
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    with NvmeSwapper("/dev/shm", 0, AioOptions()) as s:
        x = _random(77_777, torch.float32, seed=3)
        s.reserve("x", x.numel() * 4)
        s.write("x", x)
        out = aligned_empty(x.numel(), torch.float32)
        s.read("x", out).result(timeout=60)
        assert torch.equal(out, x)
        print(f"\n/dev/shm: {'O_DIRECT' if s.direct else 'buffered'} I/O")
    assert not os.path.exists(os.path.dirname(s.directory))


def test_check_space(tmp_path):
    with NvmeSwapper(tmp_path, 0, AioOptions()) as s:
        s.check_space(1 << 20)
        with pytest.raises(SwapError, match=str(tmp_path)) as info:
            s.check_space(1 << 70)
        assert info.value.errno == errno.ENOSPC
        assert s.padded_size(1) == s.padded_size(1 << 20) == 1 << 20


def test_reserve_allocates_whole_blocks(root):
    with NvmeSwapper(root, 0, AioOptions()) as s:
        s.reserve("a", 3 * (1 << 20) + 5)
        s.reserve("empty", 0)
        assert s.bytes_on_disk() == 4 << 20
        (name,) = [n for n in os.listdir(s.directory) if n.endswith("-a.swp")]
        st = os.stat(os.path.join(s.directory, name))
        assert st.st_size == 4 << 20
        assert st.st_blocks * 512 >= 4 << 20  # really allocated, not sparse
        s.write("empty", torch.empty(0)).result(timeout=60)
        s.read("empty", torch.empty(0)).result(timeout=60)


def test_reserve_beyond_free_space_raises_naming_the_file(tmp_path):
    with NvmeSwapper(tmp_path, 0, AioOptions()) as s:
        with pytest.raises(SwapError, match=s.directory) as info:
            s.reserve("huge", 1 << 62)
        assert info.value.errno == errno.ENOSPC
        assert s.bytes_on_disk() == 0 and os.listdir(s.directory) == []
        s.reserve("huge", 4096)  # the key is free again


def test_reserve_reports_enospc_from_fallocate(tmp_path, monkeypatch):
    with NvmeSwapper(tmp_path, 0, AioOptions()) as s:

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(SwapError, match=s.directory) as info:
            s.reserve("k", 1 << 20)
        assert info.value.errno == errno.ENOSPC
        assert "No space left" in str(info.value)
        assert os.listdir(s.directory) == [] and s.bytes_on_disk() == 0


def test_reserve_without_fallocate_support_makes_a_sparse_file(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with NvmeSwapper(tmp_path, 0, SMALL) as s:
        x = _random(50_001, torch.float32, seed=5)
        s.reserve("x", x.numel() * 4)
        s.write("x", x)
        out = aligned_empty(x.numel(), torch.float32)
        s.read("x", out).result(timeout=60)
        assert torch.equal(out, x)


def test_misuse_is_refused_at_the_call(tmp_path):
    with NvmeSwapper(tmp_path, 0, AioOptions()) as s:
        with pytest.raises(KeyError):
            s.write("nope", torch.zeros(4))
        s.reserve("k", 16)
        with pytest.raises(ValueError, match="already reserved"):
            s.reserve("k", 16)
        with pytest.raises(ValueError, match="never written"):
            s.read("k", aligned_empty(4, torch.float32))
        with pytest.raises(ValueError, match="bytes"):
            s.write("k", torch.zeros(5))
        with pytest.raises(ValueError, match="contiguous"):
            s.write("k", torch.zeros(4, 2).t()[0])
        with pytest.raises(ValueError):
            s.reserve("neg", -1)


def test_an_io_failure_reaches_the_future_wait_all_and_later_reads(tmp_path, monkeypatch):
    with NvmeSwapper(tmp_path, 0, SMALL) as s:
        s.reserve("k", 100_000 * 4)

        def broken(fd, data, offset):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(swap, "_pwrite_all", broken)
        future = s.write("k", torch.ones(100_000))
        read = s.read("k", aligned_empty(100_000, torch.float32))
        with pytest.raises(SwapError, match=s.directory) as info:
            future.result(timeout=60)
        assert info.value.errno == errno.EIO and "write of 'k'" in str(info.value)
        with pytest.raises(SwapError, match="earlier write"):
            read.result(timeout=60)
        with pytest.raises(SwapError):
            s.wait_all()
        s.wait_all()  # raised once
        monkeypatch.undo()
        s.write("k", torch.ones(100_000))  # a good write makes the key readable again
        out = aligned_empty(100_000, torch.float32)
        s.read("k", out).result(timeout=60)
        assert torch.equal(out, torch.ones(100_000))
    assert _leftovers(tmp_path) == []


def test_throughput_report(root):
    """Rough numbers for `pytest -s`; nothing is asserted about speed."""
    numel, count = 16 << 20, 4  # 4 x 64 MiB of fp32
    with NvmeSwapper(root, 0, AioOptions()) as s:
        buffers = [aligned_empty(numel, torch.float32).fill_(i) for i in range(count)]
        for i in range(count):
            s.reserve(f"b{i}", numel * 4)
        start = time.perf_counter()
        for i, b in enumerate(buffers):
            s.write(f"b{i}", b)
        s.wait_all()
        mid = time.perf_counter()
        for i, b in enumerate(buffers):
            s.read(f"b{i}", b)
        s.wait_all()
        end = time.perf_counter()
        total = numel * 4 * count
        mode = "O_DIRECT" if s.direct else "buffered"
        print(
            f"\nswap {root} ({mode}): write {total / (mid - start) / 1e9:.2f} GB/s, "
            f"read {total / (end - mid) / 1e9:.2f} GB/s"
        )
        for i, b in enumerate(buffers):
            assert bool((b == i).all())
