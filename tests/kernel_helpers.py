"""Shared by the kernel tests: tree shapes as parent lists, the path walk, and the comparison."""
import contextlib

import torch


def chain(n):
    return [-1] + list(range(n - 1))


def star(n):
    return [-1] + [0] * (n - 1)


def full_binary(n):
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def random_tree(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def common_trees():
    """The tree shapes both kernel suites test; each adds its own edge cases."""
    return {
        "one_node": [-1],
        "star6": star(6),
        "deep_chain12": chain(12),
        "shallow_depth1": [-1, 0, 0],
        "binary63": full_binary(63),
    }


def path_to(parents, t):
    """Root-to-``t`` node indices, by walking parent pointers (independent of stree.tree)."""
    path = []
    while t >= 0:
        path.append(t)
        t = parents[t]
    return path[::-1]


def ancestor_mask(rows):
    """(b, n, n) bool from one parent list per batch row."""
    n = len(rows[0])
    mask = torch.zeros(len(rows), n, n, dtype=torch.bool)
    for b, parents in enumerate(rows):
        for t in range(n):
            mask[b, t, path_to(parents, t)] = True
    return mask


def padded_paths(rows, ends, k):
    """(b, k) int64 root-to-``ends[b]`` paths of each row's parent list, -1 padded."""
    out = torch.full((len(rows), k), -1, dtype=torch.int64)
    for b, (parents, end) in enumerate(zip(rows, ends)):
        path = path_to(parents, end)
        out[b, :len(path)] = torch.tensor(path)
    return out


def assert_close(actual, expected, tol, what):
    """``tol = (atol, rtol)``; fails on NaN (an unwritten output slot) and prints the max error."""
    atol, rtol = tol
    actual, expected = actual.double(), expected.double()
    err = (actual - expected).abs()
    bad = err > atol + rtol * expected.abs()
    assert not torch.isnan(actual).any(), f"{what}: NaN in output (unwritten slot?)"
    assert not bad.any(), (f"{what}: max abs error {err.max().item():.3e} at "
                           f"{tuple(int(i) for i in (err == err.max()).nonzero()[0])}, "
                           f"{int(bad.sum())} elements beyond atol={atol}, rtol={rtol}")


@contextlib.contextmanager
def nan_filled_empty():
    """torch.empty fills floats with NaN in deterministic mode, so a slot a kernel skips fails."""
    assert torch.utils.deterministic.fill_uninitialized_memory
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)
