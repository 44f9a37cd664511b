"""Shared cases for the kernel tests: adapter popularity patterns (Punica's test matrix),
segment layouts and random zero-padded adapter stacks.
"""

from __future__ import annotations

import torch

from clora.kernels import SegmentMeta

PATTERNS = ("distinct", "uniform", "zipf", "identical", "skewed", "empty_segments")


def adapter_ids(pattern: str, tokens: int, num_adapters: int, seed: int = 0) -> torch.Tensor:
    """Per-token adapter slots (batch order) for a popularity pattern; -1 = base only.

    distinct:        round-robin, every token's neighbour uses another adapter
    uniform:         uniform over slots, with some base-only tokens
    zipf:            slot i drawn with probability ~ 1 / (i + 1)^1.5
    identical:       every token uses the same (last) slot; other segments empty
    skewed:          ~90% of tokens on slot 0, the rest spread, a few base-only
    empty_segments:  only even slots used, interleaved with base-only tokens
    """
    g = torch.Generator().manual_seed(seed)
    if pattern == "distinct":
        return torch.arange(tokens) % num_adapters
    if pattern == "uniform":
        return torch.randint(-1, num_adapters, (tokens,), generator=g)
    if pattern == "zipf":
        p = 1.0 / torch.arange(1, num_adapters + 1, dtype=torch.float64) ** 1.5
        return torch.multinomial(p, tokens, replacement=True, generator=g)
    if pattern == "identical":
        return torch.full((tokens,), num_adapters - 1)
    if pattern == "skewed":
        ids = torch.randint(-1, num_adapters, (tokens,), generator=g)
        return torch.where(torch.rand(tokens, generator=g) < 0.9, torch.zeros_like(ids), ids)
    if pattern == "empty_segments":
        evens = torch.arange(0, num_adapters, 2)
        ids = evens[torch.randint(0, len(evens), (tokens,), generator=g)]
        return torch.where(torch.arange(tokens) % 3 == 0, torch.full_like(ids, -1), ids)
    raise ValueError(f"unknown popularity pattern {pattern!r}")


def sorted_meta(pattern: str, tokens: int, num_adapters: int, seed: int = 0) -> SegmentMeta:
    return SegmentMeta.from_token_adapter_ids(adapter_ids(pattern, tokens, num_adapters, seed), num_adapters)


def stacked_adapters(
    ranks: list[int], hidden_in: int, hidden_out: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random A (n, in, max_rank), B (n, max_rank, out) zero-padded past each rank, scale (n,)."""
    g = torch.Generator().manual_seed(seed + 1)
    n, r = len(ranks), max(ranks)
    a = torch.zeros(n, hidden_in, r)
    b = torch.zeros(n, r, hidden_out)
    for i, rank in enumerate(ranks):
        a[i, :, :rank] = torch.randn(hidden_in, rank, generator=g) / hidden_in**0.5
        b[i, :rank] = torch.randn(rank, hidden_out, generator=g) / rank**0.5
    scale = torch.tensor([(2.0 + i) / rank for i, rank in enumerate(ranks)], dtype=torch.float32) * 4  # alpha / rank
    return a.to(dtype), b.to(dtype), scale


def assert_within_rounding(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, depth: int,
                           what: str = "") -> None:
    """`got` (fp32) equals `exact` (the same arithmetic in fp64) up to fp32 rounding, elementwise.

    The classic bound for a sum of products: |fl(sum) - sum| <= gamma_n * sum |terms|, with
    gamma_n = n * u / (1 - n * u), u = fp32's unit roundoff and n the length of the reduction
    chain (`depth`: every product and accumulation that fed the element). `magnitude` is that
    sum of |terms| per element, which the same arithmetic computes when run on absolute values
    in fp64. So the tolerance grows with the reduction as the rounding does, on any machine's
    BLAS order, and a wrong term (an error of the size of a term) still fails it."""
    u = torch.finfo(torch.float32).eps / 2
    gamma = depth * u / (1 - depth * u)
    bound = gamma * magnitude + torch.finfo(torch.float32).tiny
    err = (got.double() - exact).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, (f"{what}: error {err.max().item():.3g} exceeds the fp32 rounding bound "
                          f"(worst element at {worst:.2f}x its bound {bound.flatten()[(err / bound).argmax()].item():.3g})")
