"""Secure aggregation (after Bonawitz et al. 2017, "Practical Secure Aggregation for
Privacy-Preserving Machine Learning"): the server learns the sum of the round's updates, never one
client's update.

1. Fixed point: a client's (already weighted) update x is quantised to integers,
   q = round(x * 2^FRAC_BITS) mod 2^32 (|x| is clamped below 2^(31 - FRAC_BITS)), so sums wrap
   in uint32 arithmetic and the result is exact up to the quantisation step 2^-FRAC_BITS per client.
2. Agreed seeds: each client has a secret key sk and publishes pk = g^sk mod FIELD; clients i and
   j agree on s_ij = pk_j^sk_i = pk_i^sk_j (Diffie-Hellman), which the server cannot compute.
3. Masks: client i sends y_i = q_i + sum_{j > i} PRG(s_ij) - sum_{j < i} PRG(s_ij) (mod 2^32).
   In the sum over every client the masks cancel; each y_i alone is uniformly random.
4. Dropouts: before masking, each client splits sk_i into Shamir shares (threshold t = n//2 + 1,
   over GF(FIELD)) for the others, encrypted with the pairwise key so that the server, which
   routes them, cannot read them. For a client that drops after masking, the survivors reveal
   their shares of its key; the server rebuilds sk_d and removes the masks d's peers added for it.

What this simulation leaves out, and says so: the group (Z/(2^61-1))* is far too small for real
Diffie-Hellman, and there are no self-masks (the paper's second mask per client, which guards
against a server that claims an honest client dropped to unmask it). It shows the arithmetic and
the dropout recovery, not a hardened implementation.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

FIELD = 2**61 - 1  # a Mersenne prime: Shamir shares and the toy Diffie-Hellman group live in GF(FIELD)
GENERATOR = 37
MODULUS = 2**32
FRAC_BITS = 24  # quantisation step 2^-24 (6e-8); a coordinate of a sum must stay within +-128
LIMIT = 2.0 ** (31 - FRAC_BITS)


def threshold(n: int) -> int:
    """Shares needed to rebuild a key: a majority of the round's advertised clients."""
    return n // 2 + 1


def quantise(x: torch.Tensor) -> torch.Tensor:
    """Floats -> int64 holding uint32 values (two's complement of the fixed-point numbers)."""
    q = torch.round(x.double().clamp(-LIMIT, LIMIT - 2.0**-FRAC_BITS) * 2.0**FRAC_BITS).to(torch.int64)
    return torch.remainder(q, MODULUS)


def dequantise(total: torch.Tensor) -> torch.Tensor:
    """A sum mod 2^32 back to floats (read as a signed 32-bit number)."""
    total = torch.remainder(total, MODULUS)
    return torch.where(total >= 2**31, total - MODULUS, total).double() / 2.0**FRAC_BITS


def _digest(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def prg(seed: int, numel: int) -> torch.Tensor:
    """numel uint32 values (as int64) from a pairwise seed, the same on both ends."""
    gen = torch.Generator().manual_seed(_digest("mask", seed) & (2**63 - 1))
    return torch.randint(0, MODULUS, (numel,), generator=gen, dtype=torch.int64)


def _pad(seed: int) -> int:
    """A one-time pad in GF(FIELD) for a share sent over the pair's channel."""
    return _digest("share", seed) % FIELD


def share_secret(secret: int, xs: list[int], t: int) -> list[int]:
    """Shamir: the values at `xs` (non-zero) of a random polynomial of degree t-1 with f(0) = secret."""
    coeffs = [secret] + [secrets.randbelow(FIELD) for _ in range(t - 1)]
    return [sum(c * pow(x, k, FIELD) for k, c in enumerate(coeffs)) % FIELD for x in xs]


def reconstruct(points: list[tuple[int, int]]) -> int:
    """f(0) by Lagrange interpolation from t points (x, f(x))."""
    total = 0
    for i, (xi, yi) in enumerate(points):
        num = den = 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * -xj % FIELD
                den = den * (xi - xj) % FIELD
        total = (total + yi * num * pow(den, FIELD - 2, FIELD)) % FIELD
    return total


class SecAggClient:
    """One client's side of one round. `index` is its position among the round's clients (its
    Shamir x-coordinate is index + 1); peers are named by their positions too."""

    def __init__(self, index: int):
        self.index = index
        self._sk = secrets.randbelow(FIELD - 2) + 1
        self.pk = pow(GENERATOR, self._sk, FIELD)
        self.pks: dict[int, int] = {}
        self.held: dict[int, int] = {}  # peer -> that peer's encrypted share of its key, for me

    def _seed(self, peer: int) -> int:
        return pow(self.pks[peer], self._sk, FIELD)

    def share_keys(self, pks: dict[int, int]) -> dict[int, int]:
        """Given the advertised keys: encrypted shares of my key, one per other advertised client."""
        self.pks = pks
        peers = [j for j in sorted(pks) if j != self.index]
        shares = share_secret(self._sk, [j + 1 for j in peers], threshold(len(pks)))
        return {j: (s + _pad(self._seed(j))) % FIELD for j, s in zip(peers, shares)}

    def mask(self, q: torch.Tensor) -> torch.Tensor:
        y = q.clone()
        for j in self.pks:
            if j != self.index:
                m = prg(self._seed(j), q.numel())
                y = y + m if j > self.index else y - m
        return torch.remainder(y, MODULUS)

    def reveal(self, dropped: list[int]) -> dict[int, int]:
        """My decrypted shares of the dropped clients' keys."""
        return {d: (self.held[d] - _pad(self._seed(d))) % FIELD for d in dropped if d in self.held}


def unmask(
    total: torch.Tensor,
    present: list[int],
    dropped: list[int],
    pks: dict[int, int],
    revealed: dict[int, dict[int, int]],
) -> torch.Tensor | None:
    """The sum of the present clients' q, from the sum of their y; `revealed[d]` maps a present
    client to its share of d's key. None when some dropped key has fewer than t shares."""
    t = threshold(len(pks))
    for d in dropped:
        points = [(j + 1, s) for j, s in sorted(revealed.get(d, {}).items())][:t]
        if len(points) < t:
            return None
        sk = reconstruct(points)
        for s in present:  # y_s carries +PRG(s_sd) when d > s, -PRG(s_sd) when d < s
            m = prg(pow(pks[s], sk, FIELD), total.numel())
            total = total - m if d > s else total + m
    return torch.remainder(total, MODULUS)


def run_in_process(
    inputs: dict[int, torch.Tensor],
    drop_after_masking: set[int] | frozenset[int] = frozenset(),
    server_view: list | None = None,
) -> tuple[torch.Tensor | None, list[int]]:
    """One round among clients in this process (world 1, and tests): `inputs` maps a client's
    position to its quantised update. Returns (sum of the survivors' q, survivors); every message
    the server receives is appended to `server_view`."""
    view = server_view if server_view is not None else []
    clients = {i: SecAggClient(i) for i in inputs}
    pks = {i: c.pk for i, c in clients.items()}
    view.append(("keys", dict(pks)))
    for i, c in clients.items():
        sent = c.share_keys(pks)
        view.append(("shares", i, dict(sent)))  # encrypted: the server routes them
        for j, s in sent.items():
            clients[j].held[i] = s
    present = [i for i in sorted(inputs) if i not in drop_after_masking]
    masked = {i: clients[i].mask(inputs[i]) for i in sorted(inputs)}  # the dropped masked, then left
    total = torch.zeros_like(next(iter(inputs.values())))
    for i in present:
        view.append(("masked", i, masked[i]))
        total = total + masked[i]
    dropped = sorted(drop_after_masking & set(inputs))
    revealed: dict[int, dict[int, int]] = {d: {} for d in dropped}
    for i in present:
        for d, s in clients[i].reveal(dropped).items():
            revealed[d][i] = s
    view.append(("revealed", revealed))
    return unmask(torch.remainder(total, MODULUS), present, dropped, pks, revealed), present
