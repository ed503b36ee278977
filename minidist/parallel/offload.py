"""ZeRO-Infinity's NVMe tier (Rajbhandari et al. 2021, arXiv 2104.07857), on a disk. Over 400
lines but one idea: the files (DiskStore) and the optimizer that streams its state through
them (OffloadedAdamW) change together, every byte read and written counted; zero.py only
chooses it.

    zero = ZeRO(model, opt, comm, stage=3, units=Units(model, comm),
                offload="disk", offload_dir="/scratch/me", chunk_bytes=4 * 2**20)
    with zero:                         # or zero.close(): the files go
        train_step(model, zero, batches, lr, clip, dp=zero)
        zero.offload_bytes()           # {"bytes_read": ..., "bytes_written": ..., "steps": ...}

ZeRO already cuts AdamW's state in N: each rank keeps m and v for its partition only.
ZeRO-Infinity moves what is left out of accelerator memory: here, out of the process's
resident memory into files. With `offload="disk"` each rank keeps in `offload_dir`
- `rank{R:05d}.exp_avg.f64` and `rank{R:05d}.exp_avg_sq.f64`: AdamW's m and v of its
  partition (R the rank in COMM_WORLD, so ranks of several data-parallel groups can share
  a folder; f32 for float32 runs), and
- with stage 3, `rank{R:05d}.param.f64`: its parameter shards (every unit's `group.shard`).
Each file holds the partition end to end (the order of zero.groups and their pieces), so
its size is the partition's bytes. The files are numpy.memmap mappings; the arrays other
code sees (`zero.inner.state[id(q)]["exp_avg"]`, `group.shard`, a stage-3 piece's `.data`)
are plain ndarray views of those mappings, so a checkpoint reads and writes them as usual.

The optimizer step goes chunk by chunk (at most `chunk_bytes` of each array at once): read
m, v (stage 3: the shard; offloaded: the gradient) of one chunk into small buffers, run
optim.AdamW's own step on a temporary Parameter over that chunk whose state points at the
buffers, write the buffers back, and tell the kernel the chunk's pages may leave this
process (madvise(MADV_DONTNEED) on the mapping: a shared file mapping keeps its data in
the page cache and the file; only this process's resident set shrinks). AdamW is
element-wise, so a chunk's update is the update of those elements: the bits equal the
in-memory run's. The formula lives once, in optim.AdamW. After the step the dirty pages
are flushed (msync) and dropped from the page cache (posix_fadvise DONTNEED), so the
state really is in the files between steps and the next step reads the disk.

Prefetch (on by default, `prefetch=False` turns it off): a reader thread reads chunk i+1
into a second set of buffers while chunk i steps (NumPy's copies and element-wise
arithmetic release Python's lock, so the two overlap); the bits do not change.

Gradients (`offload_grads()`, which lesson 11's offloaded runs call): as ZeRO-Offload
(Ren et al. 2021) copies each reduced gradient partition to CPU memory during the
backward, each group's add_grad is wrapped so the reduced partition goes into the
`rank{R:05d}.grad.f64` file as it arrives, and the step reads it from there. Clipping
(optim.clip_grad_norm) scales into a new array; the step writes that into the file first.

What stays in memory: the weights the forward and backward use (stages 1, 2: all of
them; stage 3: the gathered units), the activations, full-size gradients until they are
reduced, and the chunk buffers (two sets with prefetch).

What a step moves, per rank (`stats`; `stats["read_by_kind"]` splits the reads): each
array read once and written once, so 2 x 2 x partition bytes for m and v, plus 2 x
partition bytes of shards with stage 3, plus the gradients' when they are offloaded. The
forward and backward gathers of stage 3 read the shards through the mapping (the page
cache, or the disk if the kernel evicted them): those reads are not counted here; they
bring the shards back into the resident set until the next step drops them again.

On a device (MINIDIST_DEVICE=cuda or strict) the files are host memory and the step runs
on the device: each chunk of m and v crosses to the device to step (DiskStore.read,
xp.asarray: counted host to device) and back to its file (DiskStore.write, to_numpy:
counted device to host), 2 x 2 x partition bytes of m and v a step; these copies are the
point of offloading, the price of the device memory it frees. Only m and v go there:
a file's views are host arrays, and stage 3's shards (the forward gathers them) and the
reduced gradients (clipping reads them) must stay device arrays for the code that reads
them; moving those too would need the gather and the reduce-scatter to read and write
the files chunk by chunk, which this project does not do.

`offload="host"`: ZeRO-Offload's CPU tier. On the NumPy backend host and device are one
memory, so there is nothing to move: a ValueError says so. With CuPy it would mean NumPy
arrays in pinned host memory; that is not implemented (NotImplementedError).

Files are created when the ZeRO object is built (an existing file is an error: another
run, or a crashed one, owns it), removed by `close()`, by leaving its `with` block, when
the store is garbage collected, and at interpreter exit (weakref.finalize). A run killed
by a signal or MPI_Abort leaves them behind. Nothing is ever pickled.

`rss_bytes()` measures what this is for: the resident set of this process.
"""
import mmap
import os
import shutil
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from minidist.backend import to_device, to_numpy, xp
from minidist.nn import Parameter
from minidist.optim import AdamW

KINDS = ("exp_avg", "exp_avg_sq")          # AdamW's m and v, the names its state dict uses
HOST_IS_DEVICE = ("offload='host': on the NumPy backend host and device are one memory, so there "
                  "is nothing to move; offload='disk' puts the optimizer state in files")


# ----------------------------------------------------------------------------- memory


def rss_bytes():
    """This process's resident set size now, in bytes.

    Linux: VmRSS from /proc/self/status (anonymous memory, file mappings such as these
    memmaps while their pages are mapped, shared memory). Elsewhere the fallback is
    resource.getrusage(RUSAGE_SELF).ru_maxrss: the PEAK resident size so far, not the
    current one (KiB on Linux, bytes on macOS; converted to bytes here)."""
    v = _proc_status("VmRSS")
    if v is not None:
        return v
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_rss_bytes():
    """The largest resident set so far (VmHWM on Linux, getrusage's maxrss elsewhere)."""
    v = _proc_status("VmHWM")
    if v is not None:
        return v
    return rss_bytes()


def reset_peak_rss():
    """Start peak_rss_bytes() again from the current size (Linux: writes 5 to
    /proc/self/clear_refs). Returns False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_status(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024       # "VmRSS:   123456 kB"
    except (OSError, ValueError, IndexError):
        pass
    return None


# ----------------------------------------------------------------------------- the files


def suffix(dtype):
    """'f64' for float64, 'f32' for float32: the dtype in a file's name."""
    dtype = np.dtype(dtype)
    return f"{dtype.kind}{8 * dtype.itemsize}"


def _remove(paths, folder):
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    if folder is not None:                   # a folder this store made itself
        shutil.rmtree(folder, ignore_errors=True)


class DiskStore:
    """One numpy.memmap file per array kind for this rank, and the bytes moved through them.

    folder: where the files go (None: a fresh temporary folder, removed with the files).
    rank: the number in the file names (COMM_WORLD's rank: unique on a shared folder)."""

    def __init__(self, folder, rank, chunk_bytes=4 * 2**20):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be at least 1, not {chunk_bytes}")
        made = None
        if folder is None:
            folder = made = tempfile.mkdtemp(prefix=f"minidist-offload-{rank:05d}-")
        os.makedirs(folder, exist_ok=True)
        self.folder, self.rank, self.chunk_bytes = str(folder), rank, int(chunk_bytes)
        self.maps, self.paths = {}, {}       # kind -> np.memmap (the whole file), its path
        self.stats = {"bytes_read": 0, "bytes_written": 0, "steps": 0, "read_by_kind": {}}
        self._to_remove = []                 # the finalizer's own list: it must not hold self
        self._finalizer = weakref.finalize(self, _remove, self._to_remove, made)
        self.closed = False

    def path(self, kind, dtype):
        return os.path.join(self.folder, f"rank{self.rank:05d}.{kind}.{suffix(dtype)}")

    def create(self, kind, n, dtype):
        """A new file of n zeros (sparse: nothing is written yet), mapped. Returns the map."""
        path = self.path(kind, dtype)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise FileExistsError(
                f"{path} exists: another ZeRO with offload='disk' owns it (close() it first), or a run "
                "that was killed left it behind (remove it), or give another offload_dir") from None
        self._to_remove.append(path)  # removed with the others, whatever happens next
        try:
            os.ftruncate(fd, n * np.dtype(dtype).itemsize)
        finally:
            os.close(fd)
        # mmap cannot map an empty file: a rank whose partition is empty holds an empty array
        self.maps[kind] = np.memmap(path, dtype, "r+", shape=(n,)) if n else np.zeros(0, dtype)
        self.paths[kind] = path
        return self.maps[kind]

    def view(self, kind, lo, hi):
        """Elements lo:hi of a kind's file, as a plain ndarray over the mapping."""
        return self.maps[kind][lo:hi].view(np.ndarray)

    # -- moving bytes, counted
    def read(self, kind, lo, hi, out):
        """File elements lo:hi into `out` (a buffer, host or device)."""
        out[...] = self.maps[kind][lo:hi] if xp is np else to_device(self.maps[kind][lo:hi])
        self.stats["bytes_read"] += out.nbytes
        by = self.stats["read_by_kind"]
        by[kind] = by.get(kind, 0) + out.nbytes

    def write(self, kind, lo, arr):
        """`arr` into file elements lo:lo+arr.size."""
        self.maps[kind][lo:lo + arr.size] = to_numpy(arr).reshape(-1)
        self.stats["bytes_written"] += arr.nbytes

    def drop(self, kind, lo=0, hi=None):
        """Let the pages of elements lo:hi leave this process's resident set (their data
        stays in the page cache and the file). A no-op where madvise is missing."""
        mm = self.maps.get(kind)
        raw = getattr(mm, "_mmap", None)     # numpy.memmap's mmap.mmap
        if raw is None or not hasattr(raw, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        item = mm.itemsize
        hi = mm.size if hi is None else hi
        page = mmap.PAGESIZE
        start = (lo * item) // page * page
        end = min(len(raw), -(-(hi * item) // page) * page)
        if end > start:
            raw.madvise(mmap.MADV_DONTNEED, start, end - start)

    def flush(self):
        for mm in self.maps.values():
            if isinstance(mm, np.memmap):
                mm.flush()

    def evict(self):
        """Ask the kernel to drop the files' clean pages from the page cache too (after
        flush()), so the next step reads them from the disk, as the NVMe tier does; a
        no-op where posix_fadvise is missing."""
        if not hasattr(os, "posix_fadvise"):
            return
        for path in self.paths.values():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def file_bytes(self):
        """{kind: size of its file on disk (its length, not the blocks it uses)}."""
        return {k: os.path.getsize(p) for k, p in self.paths.items()}

    def close(self):
        """Remove the files (arrays still pointing at the mappings stay readable: an
        unlinked file lives until its last mapping goes)."""
        self.closed = True
        self._finalizer()


# ----------------------------------------------------------------------------- the step


class OffloadedAdamW:
    """optim.AdamW's step over a ZeRO's pieces, with m, v (and stage 3's shards) in files.

    inner: the ZeRO's AdamW over its pieces (zero.inner); its state dict keeps
    {"step", "exp_avg", "exp_avg_sq"} per piece as always, the two arrays being views of
    the files. groups: the ZeRO's groups. shards: stage 3 (the groups' shards move too).
    grads: the reduced gradient partition goes to a file as it arrives (offload_grads()),
    as ZeRO-Offload moves it to CPU memory during the backward; off by default (ZeRO's
    own `offload="disk"` keeps the optimizer state and the shards in files).
    prefetch: a reader thread fetches the next chunk while this one steps (False: in turn)."""

    def __init__(self, inner, groups, store, shards=False, grads=False, prefetch=True):
        self.inner, self.groups, self.store, self.shards = inner, groups, store, shards
        self.prefetch = prefetch
        pieces = [q for g in groups for q in g.pieces]
        dtypes = {np.dtype(q.dtype) for q in pieces} or {np.dtype(groups[0].dtype if groups else np.float64)}
        if len(dtypes) > 1:
            raise NotImplementedError(f"offload='disk' keeps one file per kind: pieces of dtypes {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.offset = {}                     # id(piece) -> its first element in the files
        self._views = {}
        base = 0
        spans = []
        for g in groups:
            for q, (_, start) in zip(g.pieces, g._piece_spans()):
                self.offset[id(q)] = base + start
            spans.append((g, base))
            base += g.hi - g.lo
        self.n = base                        # the partition's elements
        for kind in KINDS:
            store.create(kind, self.n, self.dtype)
        if shards:
            store.create("param", self.n, self.dtype)
            for g, b in spans:               # the shard moves into the file; pieces view it there
                store.write("param", b, g.shard)
                g.shard = store.view("param", b, b + g.shard.size)
                for q, (_, start) in zip(g.pieces, g._piece_spans()):
                    q.data = g.shard[start:start + q.size].reshape(q.shape)
            store.flush()
            store.drop("param")
        self.spans, self.grads = spans, False
        if grads:
            self.offload_grads()
        self.initial_write = store.stats["bytes_written"]
        self.chunk = max(1, store.chunk_bytes // self.dtype.itemsize)
        self.buffers = None                  # chunk-sized scratch, made for each step and reused within it
        self.read_seconds = 0.0
        self.runner = AdamW([Parameter(xp.zeros(1, self.dtype))])   # runs AdamW's step on one chunk

    def offload_grads(self):
        """From now on each group's reduced gradient partition goes to the "grad" file as it
        arrives (its add_grad is wrapped), and the step reads it from there chunk by chunk."""
        if self.grads or self.n == 0 or xp is not np:      # on a device they stay there (above)
            return
        self.store.create("grad", self.n, self.dtype)
        for g, b in self.spans:
            g.add_grad = _grad_to_file(g, self.store, b)
        self.grads = True

    def views(self, q):
        """{kind: the piece's elements of that file, shaped as the piece}."""
        if id(q) not in self._views:
            o = self.offset[id(q)]
            self._views[id(q)] = {k: self.store.view(k, o, o + q.size).reshape(q.shape) for k in KINDS}
        return self._views[id(q)]

    def state_of(self, q):
        """The piece's AdamW state, its arrays in the files: made (step 0, zeros) at the
        first step as AdamW makes it; an array put there by someone else (a checkpoint's
        load) is copied into the file and replaced by the view."""
        s = self.inner.state.get(id(q))
        views = self.views(q)
        if s is None:
            s = self.inner.state[id(q)] = {"step": 0, **views}   # AdamW's zeros: the new file's
            return s
        o = self.offset[id(q)]
        for k in KINDS:
            if s.get(k) is not views[k] and not _is_view_of(s.get(k), views[k]):
                if s.get(k) is not None:
                    self.store.write(k, o, s[k])
                s[k] = views[k]
        return s

    def _fetch(self, item, buf):
        """Read one chunk's m, v (stage 3: shard; offloaded: gradient) into `buf` (the reader)."""
        t0 = time.perf_counter()
        _, q, _, a, b = item
        o, store = self.offset[id(q)], self.store
        for k in buf:
            if k == "grad" and not self.grads:
                buf[k][:b - a] = q.grad.reshape(-1)[a:b]          # in memory
            else:
                store.read(k, o + a, o + b, buf[k][:b - a])
        self.read_seconds += time.perf_counter() - t0

    def _adopt_grad(self, q):
        """Offloaded gradients: a piece whose gradient is not the file's (clipping scaled it
        into a new array: optim.clip_grad_norm never writes into a shared one) has it
        written into the file, and the piece points there again."""
        o = self.offset[id(q)]
        view = self.store.view("grad", o, o + q.size).reshape(q.shape)
        if not _is_view_of(q.grad, view):
            self.store.write("grad", o, q.grad)
            q.grad = view

    def step(self):
        """AdamW on every piece that has a gradient, chunk by chunk through the files; with
        prefetch, chunk i+1 is read by a second thread while chunk i steps (double buffers)."""
        if self.store.closed:
            raise RuntimeError("this ZeRO's offload files were removed (close()): it cannot step any more")
        store, c = self.store, self.chunk
        self.read_seconds = 0.0              # this step's time in _fetch (the reader's, with prefetch)
        work = []                            # (param group, piece, its state, a, b): every chunk
        for group in self.inner.param_groups:
            for q in group["params"]:
                if q.grad is not None:
                    if self.grads:
                        self._adopt_grad(q)
                    s = self.state_of(q)
                    work += [(group, q, s, a, min(q.size, a + c)) for a in range(0, q.size, c)]
        kinds = KINDS + (("param",) if self.shards else ()) + ("grad",)
        size = min(c, max(self.n, 1))
        sets = [{k: xp.empty(size, self.dtype) for k in kinds} for _ in range(2 if self.prefetch else 1)]
        runner = self.runner
        runner.variance_frozen = self.inner.variance_frozen
        reader = ThreadPoolExecutor(1, "offload-prefetch") if self.prefetch and len(work) > 1 else None
        try:
            pending = reader.submit(self._fetch, work[0], sets[0]) if reader else None
            for i, (group, q, s, a, b) in enumerate(work):
                buf = sets[i % len(sets)]
                if reader:
                    pending.result()         # chunk i is in; start reading chunk i+1 now
                    pending = reader.submit(self._fetch, work[i + 1], sets[(i + 1) % 2]) if i + 1 < len(work) else None
                else:
                    self._fetch(work[i], buf)
                n = b - a
                m, v = buf["exp_avg"][:n], buf["exp_avg_sq"][:n]
                p = buf["param"][:n] if self.shards else q.data.reshape(-1)[a:b]   # stages 1, 2: in memory
                t = Parameter(p)
                t.grad = buf["grad"][:n]
                chunk_state = {"step": s["step"], "exp_avg": m, "exp_avg_sq": v}
                if "v_step" in s:
                    chunk_state["v_step"] = s["v_step"]
                runner.param_groups = [{**group, "params": [t]}]
                runner.state = {id(t): chunk_state}
                runner.step()                # optim.AdamW's own formula
                o = self.offset[id(q)]
                store.write("exp_avg", o + a, m)
                store.write("exp_avg_sq", o + a, v)
                if self.shards:
                    store.write("param", o + a, p)
                for k in store.maps:
                    store.drop(k, o + a, o + b)
                if b == q.size:              # the piece's last chunk: every chunk stepped from one count
                    s["step"] = chunk_state["step"]
                    if "v_step" in chunk_state:
                        s["v_step"] = chunk_state["v_step"]
        finally:
            if reader:
                reader.shutdown(wait=True)
        runner.param_groups, runner.state = [], {}
        store.flush()
        store.evict()
        store.stats["steps"] += 1


def _grad_to_file(group, store, base):
    """group.add_grad, with the reduced partition accumulated in the "grad" file: the group's
    grad and its pieces' grads become views of the file, and the pages leave the resident set."""
    def add_grad(part):
        part = part.astype(group.dtype, copy=False)
        n = part.size
        view = store.view("grad", base, base + n)
        if group.grad is None:
            store.write("grad", base, part)
        else:                                # gradient accumulation: read, add, write back
            old = np.empty(n, group.dtype)
            store.read("grad", base, base + n, old)
            store.write("grad", base, old + to_numpy(part).reshape(-1))
        group.grad = view
        for q, (_, off) in zip(group.pieces, group._piece_spans()):
            q.grad = view[off:off + q.size].reshape(q.shape)
        store.drop("grad", base, base + n)
    return add_grad


def _is_view_of(a, b):
    """a and b are the same elements (a view re-made by reshape, say)."""
    if not isinstance(a, np.ndarray) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.size == 0 or a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


def make(kind, inner, groups, comm_rank, stage, folder=None, chunk_bytes=4 * 2**20):
    """The offloaded step for ZeRO(..., offload=kind), or None for offload=None."""
    if kind is None or kind is False:
        return None
    if kind == "host":
        if xp is np:
            raise ValueError(HOST_IS_DEVICE)
        raise NotImplementedError("offload='host' with CuPy (the optimizer state in pinned host memory) is not "
                                  "implemented; on the NumPy backend host and device are one memory, so there is "
                                  "nothing to move; offload='disk' puts the optimizer state in files")
    if kind != "disk":
        raise ValueError(f"offload must be None, 'disk' or 'host', not {kind!r}")
    store = DiskStore(folder, comm_rank, chunk_bytes)
    try:                                 # on a device stage 3's shards stay there (the docstring)
        return OffloadedAdamW(inner, groups, store, shards=stage == 3 and xp is np)
    except BaseException:
        store.close()
        raise
