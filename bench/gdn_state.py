"""Per-request recurrent-state memory while a tree is verified on a Gated DeltaNet hybrid.

Three designs for the Gated DeltaNet layers of one request (attention K/V is the same in all three:
the tree's nodes are written after the prefix), with ``n`` tree nodes:

* stree: the committed state in one slot, plus what the tree forward keeps per node for the
  commit's replay (``DeltaActivations``: the pre-conv inputs ``xbc``, the normalised keys ``k``
  and ``u`` and ``G`` in fp32);
* a state per node (SGLang's tree verification keeps one full recurrent state, conv window
  included, per tree node; vLLM's TreeWY RFC keeps per-node snapshots of the same size): the
  committed slot plus ``n`` states;
* vLLM 0.32's chains: one state slot per draft position (a chain of ``n - 1`` drafts, the root's
  included: ``n`` slots).

The sizes are measured on a small Qwen3.5-shaped model (the tensors a real ``tree_forward``
leaves, summed: they must equal the formula) and computed from the formula at the shapes of
Qwen3.5-9B, -27B and -397B-A17B (their ``config.json`` values below). States in bf16 as engines
serve them (the 'state dtype' column; stree's CPU path keeps fp32 states), activations as stree
keeps them: ``xbc`` in the model's dtype, ``k``, ``u``, ``G`` in fp32.

    scripts/venv python bench/gdn_state.py          # prints the Markdown table of docs/benchmarks.md
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class GdnShape:
    """The Gated DeltaNet part of a checkpoint's ``config.json``."""
    name: str
    gdn_layers: int  # layers of type linear_attention
    key_heads: int  # linear_num_key_heads
    value_heads: int  # linear_num_value_heads
    head_dim: int  # linear_key_head_dim = linear_value_head_dim
    conv: int = 4  # linear_conv_kernel_dim

    @property
    def conv_dim(self) -> int:
        return (2 * self.key_heads + self.value_heads) * self.head_dim


# From the checkpoints' config.json (Qwen/Qwen3.5-9B, -27B, -397B-A17B on the Hugging Face hub:
# every fourth layer full attention)
SHAPES = [GdnShape("Qwen3.5-9B", 24, 16, 32, 128), GdnShape("Qwen3.5-27B", 48, 16, 48, 128),
          GdnShape("Qwen3.5-397B-A17B", 45, 16, 64, 128)]
NODES = (7, 16, 64)


def state_bytes(s: GdnShape, state_size: int = 2, act_size: int = 2) -> int:
    """One request's committed state over all GDN layers: the ``(H, dk, dv)`` state and the conv
    window ``(conv_dim, kernel)``."""
    return s.gdn_layers * (s.value_heads * s.head_dim ** 2 * state_size + s.conv_dim * s.conv * act_size)


def kept_bytes(s: GdnShape, nodes: int, act_size: int = 2) -> int:
    """What stree's tree forward keeps per node and layer for the commit: ``xbc`` (model dtype),
    ``k`` and ``u`` (one per value head) and ``G`` (per head), fp32."""
    per_node = s.conv_dim * act_size + 4 * (2 * s.value_heads * s.head_dim + s.value_heads)
    return s.gdn_layers * nodes * per_node


def designs(s: GdnShape, nodes: int, state_size: int = 2, act_size: int = 2) -> dict:
    one = state_bytes(s, state_size, act_size)
    return {"stree": one + kept_bytes(s, nodes, act_size), "state per node": (nodes + 1) * one,
            "chain slots": nodes * one}


def measured(nodes: int = 16) -> tuple[int, int, GdnShape]:
    """The bytes a real tree forward keeps and the committed state's, on a small random Qwen3.5
    model (fp32), and its shape: checks the formula."""
    import stree
    from stree.cache import DeltaActivations
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                            layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    model = stree.patch(Qwen3_5ForCausalLM(cfg).eval())
    cache = model.allocate_tree_cache(1, 64)
    model.prefill(torch.tensor([[1, 2, 3]]), cache)
    tree = stree.TokenTree(torch.randint(0, 64, (nodes,)), [-1] + [(i - 1) // 2 for i in range(1, nodes)])
    model.tree_forward(tree, cache)
    acts = [a for a in cache.pending.layers.values() if isinstance(a, DeltaActivations)]
    kept = sum(t.numel() * t.element_size() for a in acts for t in (a.xbc, a.k, a.u, a.G))
    states = [c for i, c in cache.layers.items() if isinstance(cache.pending.layers[i], DeltaActivations)]
    state = sum(c.ssm_state.nbytes + c.conv_state.nbytes for c in states)
    return kept, state, GdnShape("tiny", len(acts), 2, 4, 16)


def gib(b: int) -> str:
    return f"{b / 2 ** 30:.2f} GiB" if b >= 2 ** 30 else f"{b / 2 ** 20:.1f} MiB"


def table() -> str:
    rows = ["| model (GDN layers) | tree nodes | stree: one slot + kept activations | a state per node | "
            "chain slots (vLLM) | stree / a state per node |", "|---|---|---|---|---|---|"]
    for s in SHAPES:
        for n in NODES:
            d = designs(s, n)
            rows.append(f"| {s.name} ({s.gdn_layers}) | {n} | {gib(d['stree'])} | {gib(d['state per node'])} | "
                        f"{gib(d['chain slots'])} | {d['stree'] / d['state per node']:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    kept, state, tiny = measured()
    want_kept, want_state = kept_bytes(tiny, 16, act_size=4), state_bytes(tiny, state_size=4, act_size=4)
    print(f"measured on a small Qwen3.5 model (fp32, 16 nodes): kept {kept} B (formula {want_kept}), "
          f"state {state} B (formula {want_state})")
    if (kept, state) != (want_kept, want_state):
        print("the formula does not describe what a tree forward keeps", file=sys.stderr)
        return 1
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
