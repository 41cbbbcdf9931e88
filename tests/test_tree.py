"""TokenTree: validation and the tables shared by every layer."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree.tree import TokenTree, level_runs, parents_caterpillar, parents_from_widths


def brute_tables(parents):
    """Depth, ancestor mask and paths by walking parent pointers one node at a time."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth, paths = [], []
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.append(j)
            mask[i, j] = True
            j = parents[j]
        paths.append(path[::-1])
        depth.append(len(path) - 1)
    return torch.tensor(depth), mask, paths


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40).flatmap(
    lambda n: st.tuples(*[st.just(-1)] + [st.integers(0, i - 1) for i in range(1, n)])))
def test_tables_match_brute_force(parents):
    parents = list(parents)
    tree = TokenTree(torch.zeros(len(parents), dtype=torch.long), parents)
    depth, mask, paths = brute_tables(parents)
    assert torch.equal(tree.depth[0], depth)
    assert torch.equal(tree.mask[0], mask)
    assert tree.max_depth == int(depth.max())
    for i, p in enumerate(paths):
        row = tree.paths[0, i].tolist()
        assert row[:len(p)] == p and all(v == -1 for v in row[len(p):])


@pytest.mark.parametrize("width", [2, 4])
def test_conv_window_reaches_into_committed_inputs(width):
    # chain of 3 below the root + a side branch: windows list ancestors oldest first
    parents = [-1, 0, 1, 2, 0]
    tree = TokenTree(torch.arange(5), parents)
    win = tree.conv_window(width)[0]
    w1 = width - 1
    for i in range(5):
        _, _, paths = brute_tables(parents)
        path = paths[i]
        # sequence seen by node i: committed inputs (ext idx 0..w1-1) then its path (ext idx w1+j)
        seq = list(range(w1)) + [w1 + j for j in path]
        assert win[i].tolist() == seq[-width:]


def test_builders():
    assert parents_from_widths([3, 3, 3, 3]) == [-1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    binary = TokenTree(torch.zeros(63, dtype=torch.long), parents_from_widths([2, 4, 8, 16, 32]))
    assert binary.max_depth == 5 and all(len(binary.children(0, i)) == 2 for i in range(31))
    chain = TokenTree.chain(torch.arange(6))
    assert torch.equal(chain.mask[0], torch.ones(6, 6, dtype=torch.bool).tril())
    batch = TokenTree(torch.zeros(2, 4, dtype=torch.long), [[-1, 0, 0, 0], [-1, 0, 1, 2]])
    assert batch.depth.tolist() == [[0, 1, 1, 1], [0, 1, 2, 3]]
    assert batch.path_tokens(torch.tensor([[0, 2, -1], [0, 1, 2]])).tolist() == [[0, 0, -1], [0, 0, 0]]


@pytest.mark.parametrize("tokens,parents,msg", [
    ([], [], "empty tree"),
    ([1, 2], [0, 0], "parents\\[0\\] must be -1"),
    ([1, 2, 3], [-1, -1, 0], "several roots"),
    ([1, 2, 3], [-1, 2, 0], "parent must come before"),
    ([1, 2, 3], [-1, 0, 5], "parent must come before"),
    ([1, -2], [-1, 0], "non-negative"),
    ([[1, 2], [3]], [-1, 0], "rectangular"),
    ([1, 2], [-1, 0, 1], "parents must be"),
    ([1.5, 2.0], [-1, 0], "integer"),
], ids=["empty", "root-parent", "two-roots", "forward-parent", "out-of-range-parent",
        "negative-token", "ragged", "length-mismatch", "float-tokens"])
def test_bad_trees_raise_clear_errors(tokens, parents, msg):
    if msg == "integer":
        tokens = torch.tensor(tokens)
    with pytest.raises(ValueError, match=msg):
        TokenTree(tokens, parents)


def test_size_and_vocab_limits():
    with pytest.raises(ValueError, match="exceeds the limit"):
        TokenTree(torch.zeros(10, dtype=torch.long), list(range(-1, 9)), max_nodes=8)
    with pytest.raises(ValueError, match="out of range for vocab_size"):
        TokenTree(torch.tensor([1, 50]), [-1, 0], vocab_size=50)
    with pytest.raises(ValueError, match="positive ints"):
        parents_from_widths([2, 0])


def test_max_children_is_per_row():
    tree = TokenTree(torch.zeros(3, 5, dtype=torch.long),
                     torch.tensor([[-1, 0, 0, 0, 1], [-1, 0, 1, 2, 3], [-1, 0, 1, 1, 0]]))
    assert tree.max_children == 3
    assert TokenTree(torch.zeros(4, 3, dtype=torch.long), [-1, 0, 1]).max_children == 1
    assert TokenTree(torch.zeros(2, 1, dtype=torch.long), [-1]).max_children == 0


def test_level_runs_stop_at_each_layers_last_inner_node():
    assert level_runs([-1]) == []
    assert level_runs(parents_caterpillar([3, 2, 2])) == [(0, 1), (1, 2), (4, 5)]  # spines only
    assert level_runs(parents_from_widths([4, 4, 2, 2])) == [(0, 1), (1, 5), (5, 7), (9, 11)]


def test_row_is_that_row_alone_and_shared_by_a_templates_trees():
    """``tree.row(r)``: row r as a one-row tree (its own depth, paths, mask, children); trees made
    from one template by ``with_tokens`` share the row's structure (built once)."""
    parents = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4]]  # a tree beside a deeper chain
    template = TokenTree(torch.arange(12).view(2, 6), parents)
    for r in range(2):
        row, alone = template.row(r), TokenTree(torch.arange(6 * r, 6 * r + 6), parents[r])
        for name in ("tokens", "parents", "depth", "mask", "paths"):
            assert torch.equal(getattr(row, name), getattr(alone, name)), name
        assert row.max_depth == alone.max_depth and row.children(0, 1) == alone.children(0, 1)
    other = template.with_tokens(torch.arange(12, 24).view(2, 6))
    assert other.row(1).tokens.tolist() == [list(range(18, 24))]
    assert other.row(1).mask is template.row(1).mask  # one structure per template and row
