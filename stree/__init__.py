"""stree: speculative tree decoding for Mamba2 and hybrid Mamba2 + attention models.

    model = stree.patch(model)       # mamba_ssm, stree.hybrid or transformers Mamba2-family model
    cache = model.allocate_tree_cache(batch_size, max_seqlen)
    logits = model.prefill(input_ids, cache)         # (b, l, v); commits the prompt
    logits = model.tree_forward(tree, cache)         # (b, n, v); committed state unchanged
    cache.commit(path)                               # (b, k) accepted node indices from the root
    pool = model.allocate_state_pool(num_slots, max_seqlen)   # serving engines: rows in pool slots
    cache = pool.cache(slots)                        # (b,) slots; row r's state is slot slots[r]
    out = stree.generate(target, draft, input_ids, max_new_tokens=128, temperature=0.0)
    out = stree.generate(target, None, input_ids, drafter="suffix:16")   # no draft model
    cache = stree.SuffixCache()                      # earlier outputs, shared by generate calls
    stree.prepack_linears(model)                     # CPU fp32: faster small-batch linears
    chat = stree.Session(prefix_cache=stree.PrefixCache())   # a conversation; states shared by requests
    out = stree.generate(target, draft, turn_ids, session=chat)   # prefills only the turn's new tokens
"""
from stree.cache import StatePool, TreeCache
from stree.draft.suffix_index import SuffixCache
from stree.generation import GenerationOutput, default_drafter, generate
from stree.layers.linear import prepack_linears
from stree.patch import patch
from stree.prefix_cache import PrefixCache, PrefixCacheStats
from stree.sampling import SamplingConfig
from stree.session import Session, TurnStats
from stree.stats import GenerationStats
from stree.tree import TokenTree, parents_from_widths

__all__ = ["patch", "generate", "GenerationOutput", "GenerationStats", "TokenTree", "TreeCache",
           "StatePool", "SamplingConfig", "parents_from_widths", "prepack_linears", "default_drafter",
           "SuffixCache", "Session", "TurnStats", "PrefixCache", "PrefixCacheStats"]
__version__ = "0.1.0"
