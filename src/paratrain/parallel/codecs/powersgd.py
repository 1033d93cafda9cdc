"""PowerSGD (parallel.compression = "powersgd"): the codec (codecs/base.py) that factors
each gradient matrix: rank-r P and Q cross the wire, error feedback keeps the rest.

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
from typing import Any, cast

import torch
import torch.distributed as dist

from paratrain.comm import collectives, shm
from paratrain.comm.collectives import Handle
from paratrain.parallel.codecs.base import Codec
from paratrain.runtime.machine import cpu_multiplies_bf16_natively


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
        kw: dict[str, Any] = dict(dtype=flat.dtype, device=flat.device)
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


class PowerSGD(Codec):
    """Rank-r PowerSGD with error feedback and (optionally) warm start, per bucket."""

    def __init__(self, rank: int, warm_start: bool, seed: int = 0, timeout_s: float = 300.0):
        self.rank, self.warm_start, self.seed, self.timeout_s = rank, warm_start, seed, timeout_s
        self.state: dict = {}
        self.restored: dict[str, torch.Tensor] = {}  # loaded before the buckets' first launch
        self.local_sums: dict = {}  # group -> shm.LocalSum, made at the first launch
        # P Q^T's block of rows, one for all buckets (their reconstructions run one after another)
        self.block: torch.Tensor | None = None

    def _all_reduce(self, t: torch.Tensor, what: str, group):
        """P, Q and the dense tensors are small: on one host they are summed through shared memory
        (shm.LocalSum), elsewhere, or when large, through torch.distributed."""
        if group not in self.local_sums:
            use_shm = (
                t.device.type == "cpu"
                and dist.get_backend(group) == "gloo"
                and os.environ.get("PARATRAIN_SMALL_SHM", "1") != "0"
            )
            self.local_sums[group] = shm.LocalSum(group, self.timeout_s) if use_shm else None
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
                    M.copy_(cast(torch.Tensor, e))  # not None: checked above
        return st

    def start(self, key, flat: torch.Tensor, shapes, group, profiler, world: int) -> Handle:
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

        handle = Handle(works, second=second_round)
        return handle
