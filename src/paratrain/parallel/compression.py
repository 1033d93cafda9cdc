"""Gradient compression: how one bucket of gradients is averaged across a group.

The seam (like a DDP comm hook): before the backward, a strategy clears each bucket's flat gradient
buffer with `codec.reset(key, flat, shapes)` (not zero_(): codecs with error feedback keep last
step's error there, so backward accumulates grad + error at no extra pass over memory). It then hands
it to `codec.launch(key, flat, shapes, group, profiler)` the moment the bucket is ready and keeps the
returned handle. After the backward it calls `handle.advance()` on every bucket (a codec with a
second round of communication starts it there, so that round overlaps the next buckets' work), then
`handle.wait()`, after which `codec.result(key, flat)` holds the average over the group (exactly,
or approximately for lossy codecs): `flat` itself, or for PowerSGD a second buffer, since `flat`
keeps the error; `codec.result_norm(key)` is its 2-norm where the codec took it on the way (else
None). `key` names the bucket across steps, so codecs with memory (error feedback, warm
start) keep per-bucket state; after a step skipped for a non-finite gradient, `codec.discard(key)` (with
`flat` zeroed) drops that memory, which the bad gradient would otherwise poison for good.

    parallel.compression   what crosses the wire per bucket           exact?
    none                   the fp32 buffer, one all-reduce            yes (the equivalence promise)
    bf16 | fp16            the buffer cast to 16 bits, one all-reduce   rounding only
    topk                   the largest topk_ratio of |grad + error|     no: error feedback keeps what
                           as (value, index) pairs, one all-gather      was not sent for later steps
    powersgd               per matrix M (n x m): P = M Q (n x r) and     no: error feedback, and Q is
                           Q = M^T P (m x r), two all-reduces; 1-D       warm-started from the last
                           tensors and matrices too small to gain go     step (Vogels et al. 2019)
                           uncompressed, in P's all-reduce

Codecs with memory save it per rank through state_dict() / load_state_dict(tensors) (keys start
with the codec's name, so a checkpoint of another codec is ignored): a resumed run continues with
the same error feedback and warm start as an uninterrupted one. Memory saved for other buckets
(another parallel.bucket_mb, or powersgd_rank) is dropped: that run's codec starts empty.

PowerSGD of one bucket, phase by phase (arrows are all-reduces; P's overlaps backward, Q's the
next buckets' advance):
    reset   (before)        M = error, already in place in `flat` (backward then adds the gradient)
    launch  (in backward)   P = M Q;  ----P + dense---->
    advance (after)         P = orthonormal(P);  Q = M^T P;  ----Q---->
    wait                    Q /= N;  out = P Q^T;  M -= out (the error, left in flat)
The products run in the device's fast dtype (arithmetic_dtype): bf16 where it multiplies bf16
natively (CUDA; CPUs with AVX512-BF16 or AMX), then P and Q come from a bf16 copy of M (one cast, two
reads of half the bytes) and P Q^T is made in a cache-sized bf16 block before it is widened into the
result; fp32 elsewhere (on AVX2-only CPUs a bf16 product is emulated and ~24x slower), reading M
itself with no copy. Either way P Q^T goes a block of rows at a time, so the result and the error
make one trip to memory. Keeping the error in `flat` saves the copy back into it that a separate
error buffer would cost each step. What crosses the wire is P and Q in the gradient's own dtype
whatever the arithmetic: r (n + m) numbers against n m, so 16-bit factors would save under 1 % of
the uncompressed bytes at r8 on 2048 x 2048 while rounding P before its orthogonalisation.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from .. import collectives
from ..config import ParallelConfig
from . import shm_p2p


class Done:
    """Handle of a reduction that needed no communication (a group of one)."""

    def advance(self) -> None:
        pass

    def wait(self) -> None:
        pass


class _Work:
    """Waits for `works`, then runs `finish`; with `second` (a function that starts another round
    and returns its finishing function), advance() runs that round's start early."""

    def __init__(self, works, finish=None, second=None):
        self.works, self.finish, self.second = works, finish, second

    def _wait_works(self) -> None:  # the waits are the profile's "comm" (paratrain.collectives)
        for w in self.works:
            w.wait()
        self.works = []

    def advance(self) -> None:
        if self.second is not None:
            self._wait_works()
            self.finish, self.second = self.second(), None

    def wait(self) -> None:
        self.advance()
        self._wait_works()
        if self.finish is not None:
            self.finish()


class Stateless:
    def reset(self, key, flat: torch.Tensor, shapes) -> None:
        flat.zero_()

    def result(self, key, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def result_norm(self, key) -> torch.Tensor | None:
        """The 2-norm of result(key) where the codec had it at hand anyway, else None."""
        return None

    def discard(self, key) -> None:
        pass

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        pass


class Uncompressed(Stateless):
    """Average in the buffer's own dtype: divide, then sum (what dp always did)."""

    def launch(self, key, flat: torch.Tensor, shapes, group, profiler):
        world = dist.get_world_size(group)
        if world == 1:
            return Done()
        flat.div_(world)
        return _Work([collectives.all_reduce(flat, f"grad-bucket-{key}", group=group, async_op=True)])


class Cast(Stateless):
    """Send 16-bit floats: half the bytes, rounding error only (divided after the cast, on half the
    memory, as torch's hooks do; fp16 saturates only for gradients above 65504)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def launch(self, key, flat: torch.Tensor, shapes, group, profiler):
        world = dist.get_world_size(group)
        if world == 1:
            return Done()
        with profiler.phase("compress"):
            small = flat.to(self.dtype).div_(world)
        work = collectives.all_reduce(small, f"grad-bucket-{key}-{self.dtype}", group=group, async_op=True)

        def unpack():
            with profiler.phase("compress"):
                flat.copy_(small)

        return _Work([work], unpack)


class TopK:
    """Send the k largest entries of gradient + error as (value, index); keep the rest as error.

    Exact top-k of a large bucket costs more than the all-reduce it saves (torch.topk of 10M
    entries: ~0.7 s on one core), so big buckets pick by a threshold estimated from a random sample
    (as Deep Gradient Compression does), then trim or zero-pad to exactly k so every rank sends the
    same count. Padding is (index 0, value 0): it adds nothing."""

    EXACT_BELOW = 1 << 16
    SAMPLE = 1 << 14

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio = ratio
        self.error: dict = {}
        self.gen = torch.Generator().manual_seed(seed)

    def reset(self, key, flat: torch.Tensor, shapes) -> None:
        error = self.error.get(key)
        if error is None or error.shape != flat.shape:  # none yet, or restored for other buckets
            self.error.pop(key, None)
            flat.zero_()
        else:
            flat.copy_(error)

    def result(self, key, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def result_norm(self, key) -> None:
        return None

    def discard(self, key) -> None:
        self.error.pop(key, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"topk.{key}.error": error for key, error in self.error.items()}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            kind, key, field = name.split(".")
            if kind == "topk" and field == "error":
                self.error[int(key)] = t.clone()

    def select(self, magnitude: torch.Tensor, k: int) -> torch.Tensor:
        n = magnitude.numel()
        if n <= self.EXACT_BELOW:
            return torch.topk(magnitude, k, sorted=False).indices
        picks = torch.randint(0, n, (self.SAMPLE,), generator=self.gen).to(magnitude.device)
        sample = magnitude[picks]
        keep = max(1, round(self.SAMPLE * k / n))
        threshold = torch.topk(sample, keep, sorted=False).values.min()
        idx = (magnitude >= threshold).nonzero().squeeze(1)
        if idx.numel() > k:
            idx = idx[torch.topk(magnitude[idx], k, sorted=False).indices]
        return idx

    def launch(self, key, flat: torch.Tensor, shapes, group, profiler):
        world = dist.get_world_size(group)
        if world == 1:
            return Done()
        k = max(1, math.ceil(self.ratio * flat.numel()))
        with profiler.phase("compress"):
            error = self.error.get(key)
            if error is None:
                error = self.error[key] = torch.zeros_like(flat)
            idx = self.select(flat.abs(), k)
            values = torch.zeros(k, dtype=flat.dtype, device=flat.device)
            indices = torch.zeros(k, dtype=torch.int32, device=flat.device)
            values[: idx.numel()] = flat[idx]
            indices[: idx.numel()] = idx.to(torch.int32)
            error.copy_(flat)
            error.index_fill_(0, idx, 0)  # what is sent leaves the error; the rest waits for later steps
        all_values = torch.empty(world * k, dtype=flat.dtype, device=flat.device)
        all_indices = torch.empty(world * k, dtype=torch.int32, device=flat.device)
        works = [
            collectives.all_gather_into(all_values, values, f"topk-values-{key}", group, async_op=True),
            collectives.all_gather_into(all_indices, indices, f"topk-indices-{key}", group, async_op=True),
        ]

        def unpack():
            with profiler.phase("compress"):
                flat.zero_()
                flat.index_add_(0, all_indices.long(), all_values)
                flat.div_(world)

        return _Work(works, unpack)


def power_layout(shapes, rank: int) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """Which tensors of a bucket PowerSGD factors, (offset, n, m, r) each, reshaped to shape[0] x
    rest as torch's hook does, and which it sends whole, (offset, numel): a tensor is factored only
    where its rank-r factors are smaller than itself."""
    matrices, dense, offset = [], [], 0
    for shape in shapes:
        numel = math.prod(shape)
        n = shape[0] if len(shape) else 1
        m = numel // max(n, 1)
        r = min(rank, n, m)
        if len(shape) >= 2 and (n + m) * r < n * m:
            matrices.append((offset, n, m, r))
        else:
            dense.append((offset, numel))
        offset += numel
    return matrices, dense


def cpu_multiplies_bf16_natively() -> bool:
    """AVX512-BF16 or AMX: the CPU instructions that make a bf16 matrix product faster than fp32.
    Decided from the CPU's flags (as torch reads them), not measured: a timing taken while other
    processes load the machine could pick differently on every rank."""
    flags = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(flag is not None and flag() for flag in flags)


def arithmetic_dtype(device: torch.device, buffer_dtype: torch.dtype) -> torch.dtype:
    """What PowerSGD's products compute in: bf16 where the device multiplies it natively (CUDA,
    CPUs with AVX512-BF16 or AMX), else the gradient's own dtype: on an AVX2-only CPU a bf16
    (2048 x 8) @ (8 x 2048) took 263 ms against 11 ms in fp32."""
    if device.type == "cuda" or (device.type == "cpu" and cpu_multiplies_bf16_natively()):
        return torch.bfloat16
    return buffer_dtype


def block_numel(matrices) -> int:
    """P Q^T is made a block of rows at a time: 2^19 numbers (1 MiB of bf16, about one core's L2
    cache), or one row of the widest matrix."""
    return max([1 << 19] + [m for _, _, m, _ in matrices])


def round_numels(shapes, rank: int) -> tuple[int, int]:
    """Numbers in PowerSGD's two all-reduces of a bucket: P with the uncompressed tensors, then Q."""
    matrices, dense = power_layout(shapes, rank)
    return (
        sum(n * r for _, n, _, r in matrices) + sum(numel for _, numel in dense),
        sum(m * r for _, _, m, r in matrices),
    )


class _PowerBucket:
    """PowerSGD state of one bucket: which views are matrices, P and Q, and the result buffer.
    The error of each matrix lives in the reducer's own buffer `flat` between steps."""

    def __init__(self, flat: torch.Tensor, shapes, rank: int, seed: int, dtype: torch.dtype):
        self.matrices, self.dense = power_layout(shapes, rank)
        kw = dict(dtype=flat.dtype, device=flat.device)
        self.flat = flat
        self.out = torch.zeros_like(flat)
        # `dtype` (arithmetic_dtype) narrower than the gradient: the products read a copy of each
        # matrix in it (half the bytes, and faster where the device has bf16 instructions). The
        # factors only approximate M anyway, and the error is taken against the full-precision M and
        # the result as sent to the optimizer, so error feedback absorbs the rounding. Otherwise
        # they read M itself, which stays unchanged until reconstruct().
        self.dtype = dtype
        self.copies_matrices = dtype != flat.dtype
        self.low_views = self.views(flat)
        if self.copies_matrices:
            low = torch.empty(sum(n * m for _, n, m, _ in self.matrices), dtype=dtype, device=flat.device)
            self.low_views, lo = [], 0
            for _, n, m, _ in self.matrices:
                self.low_views.append(low[lo : lo + n * m].view(n, m))
                lo += n * m
        # P and the uncompressed tensors travel in one all-reduce (one round trip fewer per bucket)
        n_p = sum(n * r for _, n, _, r in self.matrices)
        first, second = round_numels(shapes, rank)
        self.first_round = torch.zeros(first, **kw)
        self.p_flat, self.dense_flat = self.first_round[:n_p], self.first_round[n_p:]
        self.q_flat = torch.zeros(second, **kw)
        # P and Q are kept transposed (r x n, r x m): every product then reads M row by row
        # (M^T P as a strided read of M is ~7x slower on CPU)
        self.ps, self.qs = [], []
        po = qo = 0
        for _, n, m, r in self.matrices:
            self.ps.append(self.p_flat[po : po + n * r].view(r, n))
            self.qs.append(self.q_flat[qo : qo + m * r].view(r, m))
            po, qo = po + n * r, qo + m * r
        self.out_norm: torch.Tensor | None = None  # of this step's `out`, once it is made
        self.gen = torch.Generator().manual_seed(seed)  # identical on every rank: Q starts equal
        self.fill_random_q()

    def reconstruct(
        self, M: torch.Tensor, out: torch.Tensor, Pt: torch.Tensor, Qt: torch.Tensor, block_buffer: torch.Tensor | None
    ) -> torch.Tensor:
        """out = P Q^T (the averaged gradient the optimizer reads); M -= out (the error: exactly
        what `out` leaves out of M, kept for the next step). Returns the squared 2-norm of out.

        A block of rows at a time, so that the block is still in cache when it is taken from M (and,
        in bf16, when it is widened into `out` from `block_buffer`): M and `out` make one trip to
        memory instead of three (measured 20-30 % faster per 2048 x 2048 matrix, both ranks busy).
        Without a `block_buffer` (arithmetic in out's own dtype) the product goes straight into `out`.

        The norm comes from the factors, not from a pass over `out`: ||P Q^T||^2 is the trace of
        (P^T P)(Q^T Q), two r x r products of the very factors `out` is made from (in float64, so the
        sum of squares matches the reducer's own norm of `out` to ~1e-5; what differs is only `out`'s
        rounding element by element). A NaN or inf in M reaches P, Q and so the norm."""
        P, Q = Pt.t().to(self.dtype), Qt.to(self.dtype)
        n, m = M.shape
        rows = max(1, (block_numel([]) if block_buffer is None else block_buffer.numel()) // m)
        for i in range(0, n, rows):
            dest = out[i : i + rows]
            if block_buffer is None:
                torch.mm(P[i : i + rows], Q, out=dest)
            else:
                dest.copy_(torch.mm(P[i : i + rows], Q, out=block_buffer[: dest.numel()].view(-1, m)))
            M[i : i + rows].sub_(dest)
        P64, Q64 = P.double(), Q.double()
        return (torch.mm(P64.t(), P64) * torch.mm(Q64, Q64.t())).sum()

    def fill_random_q(self) -> None:
        self.q_flat.copy_(torch.randn(self.q_flat.numel(), generator=self.gen, dtype=self.q_flat.dtype))

    def views(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t[o : o + n * m].view(n, m) for o, n, m, _ in self.matrices]

    def dense_views(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t[o : o + numel] for o, numel in self.dense]


class PowerSGD:
    """Rank-r PowerSGD with error feedback and (optionally) warm start, per bucket."""

    def __init__(self, rank: int, warm_start: bool, seed: int = 0, timeout_s: float = 300.0):
        self.rank, self.warm_start, self.seed, self.timeout_s = rank, warm_start, seed, timeout_s
        self.state: dict = {}
        self.restored: dict[str, torch.Tensor] = {}  # loaded before the buckets' first launch
        self.local_sums: dict = {}  # group -> shm_p2p.LocalSum, made at the first launch
        # P Q^T's block of rows, one for all buckets (their reconstructions run one after another)
        self.block: torch.Tensor | None = None

    def _all_reduce(self, t: torch.Tensor, what: str, group):
        """P, Q and the dense tensors are small: on one host they are summed through shared memory
        (shm_p2p.LocalSum), elsewhere, or when large, through torch.distributed."""
        if group not in self.local_sums:
            use_shm = (
                t.device.type == "cpu"
                and dist.get_backend(group) == "gloo"
                and os.environ.get("PARATRAIN_SMALL_SHM", "1") != "0"
            )
            self.local_sums[group] = shm_p2p.LocalSum(group, self.timeout_s) if use_shm else None
        local = self.local_sums[group]
        if local is not None and local.usable and t.nbytes <= local.max_bytes:
            return collectives.all_reduce_via(local.start, t, what, group=group)
        return collectives.all_reduce(t, what, group=group, async_op=True)

    def reset(self, key, flat: torch.Tensor, shapes) -> None:
        st = self.state.get(key)
        if st is None and f"powersgd.{key}.q" in self.restored:
            st = self._bucket(key, flat, shapes)  # puts the saved error into flat
        if st is None:
            flat.zero_()  # the first step: no error yet
            return
        for d in st.dense_views(flat):  # the matrices keep their error: backward adds to it
            d.zero_()

    def result(self, key, flat: torch.Tensor) -> torch.Tensor:
        st = self.state.get(key)
        return flat if st is None else st.out

    def result_norm(self, key) -> torch.Tensor | None:
        """From the factors (see _PowerBucket.reconstruct) and the small dense part: no pass over
        the whole result, which the reducer's own norm would make."""
        st = self.state.get(key)
        return None if st is None else st.out_norm

    def discard(self, key) -> None:
        """After a skipped (non-finite) step: the error in `flat` is cleared by the caller, and Q,
        computed from the bad gradient, starts afresh (the same on every rank)."""
        st = self.state.get(key)
        if st is not None:
            st.fill_random_q()

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, st in self.state.items():
            out[f"powersgd.{key}.q"] = st.q_flat
            out.update({f"powersgd.{key}.error{i}": e for i, e in enumerate(st.views(st.flat))})
        return out

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        self.restored = {k: v for k, v in tensors.items() if k.startswith("powersgd.")}
        self.state = {}

    def _bucket(self, key: int, flat: torch.Tensor, shapes) -> _PowerBucket:
        st = self.state.get(key)
        if st is None:
            dtype = arithmetic_dtype(flat.device, flat.dtype)
            st = self.state[key] = _PowerBucket(flat, shapes, self.rank, self.seed + key, dtype)
            if st.copies_matrices and (self.block is None or self.block.numel() < block_numel(st.matrices)):
                self.block = torch.empty(block_numel(st.matrices), dtype=dtype, device=flat.device)
            q = self.restored.get(f"powersgd.{key}.q")
            views = st.views(flat)
            errors = [self.restored.get(f"powersgd.{key}.error{i}") for i in range(len(views))]
            # A checkpoint's memory fits only the same buckets and rank: with another bucket_mb or
            # powersgd_rank it starts empty, as at another world size.
            if (
                q is not None
                and q.shape == st.q_flat.shape
                and all(e is not None and e.shape == M.shape for e, M in zip(errors, views))
            ):
                st.q_flat.copy_(q)
                for M, e in zip(views, errors):
                    M.copy_(e)
        return st

    def launch(self, key, flat: torch.Tensor, shapes, group, profiler):
        world = dist.get_world_size(group)
        if world == 1:
            return Done()
        with profiler.phase("compress"):
            fresh = key not in self.state
            st = self._bucket(key, flat, shapes)
            st.out_norm = None
            if not (fresh or self.warm_start):
                st.fill_random_q()
            ms = st.views(flat)
            for M, low, Pt, Qt in zip(ms, st.low_views, st.ps, st.qs):  # M = grad + error (reset() left it)
                if st.copies_matrices:
                    low.copy_(M)
                Pt.copy_(torch.mm(Qt.to(low.dtype), low.t()))  # P = M Q
            if st.dense:
                torch.cat(st.dense_views(flat), out=st.dense_flat)
        works = [self._all_reduce(st.first_round, f"powersgd-P-{key}", group)]

        def second_round():  # P has arrived: Q = M^T P, and send Q
            with profiler.phase("compress"):
                for low, Pt, Qt in zip(st.low_views, st.ps, st.qs):
                    Pt.copy_(torch.linalg.qr(Pt.t()).Q.t())  # orthonormal columns of P
                    Qt.copy_(torch.mm(Pt.to(low.dtype), low))  # Q = M^T P
            if st.q_flat.numel():
                handle.works.append(self._all_reduce(st.q_flat, f"powersgd-Q-{key}", group))
            return finish

        def finish():
            with profiler.phase("compress"):
                st.q_flat.div_(world)
                squares = [
                    st.reconstruct(M, out, Pt, Qt, self.block if st.copies_matrices else None)
                    for M, out, Pt, Qt in zip(ms, st.views(st.out), st.ps, st.qs)
                ]
                if st.dense:
                    st.dense_flat.div_(world)
                    squares.append(torch.linalg.vector_norm(st.dense_flat, dtype=torch.float64) ** 2)
                    o2 = 0
                    for out in st.dense_views(st.out):
                        out.copy_(st.dense_flat[o2 : o2 + out.numel()])
                        o2 += out.numel()
                st.out_norm = torch.stack(squares).sum().clamp(min=0).sqrt().to(st.out.dtype)

        handle = _Work(works, second=second_round)
        return handle


def kept_bytes(p: ParallelConfig, buckets: list, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes a codec keeps between steps for buckets of tensors of the given shapes and dtype on
    `device`: top-k each bucket's error; PowerSGD each bucket's averaged result, P with the
    uncompressed tensors, and Q (the error lives in the bucket itself), and where it computes in a
    narrower dtype (arithmetic_dtype) a copy of its matrices and one block of P Q^T in that dtype."""
    element_size = dtype.itemsize
    numels = [sum(math.prod(shape) for shape in shapes) for shapes in buckets]
    if p.compression == "topk":
        return sum(numels) * element_size
    if p.compression != "powersgd" or not buckets:
        return 0
    arithmetic = arithmetic_dtype(device, dtype)
    copy_size = arithmetic.itemsize if arithmetic != dtype else 0
    total, block = 0, 0
    for shapes, numel in zip(buckets, numels):
        matrices, _ = power_layout(shapes, p.powersgd_rank)
        first, second = round_numels(shapes, p.powersgd_rank)
        total += (numel + first + second) * element_size + sum(n * m for _, n, m, _ in matrices) * copy_size
        block = max(block, block_numel(matrices))
    return total + block * copy_size


CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the 16-bit codecs' wire dtypes


def build_codec(p: ParallelConfig, seed: int = 0):
    """The codec parallel.compression names (the config has checked the name and its options)."""
    if p.compression == "none":
        return Uncompressed()
    if p.compression in CAST_DTYPES:
        return Cast(CAST_DTYPES[p.compression])
    if p.compression == "topk":
        return TopK(p.topk_ratio, seed)
    return PowerSGD(p.powersgd_rank, p.powersgd_warm_start, seed, p.timeout_s)
