"""Speculative decoding (Leviathan et al., ICML 2023; Chen et al., arXiv 2302.01318): a
cheap draft proposes up to k tokens per row, the model verifies them in one multi-token
step through the same cache and kernels, the longest acceptable prefix is kept with one
token of the model's own after it, and every row's cache is rolled back
(:meth:`~kvlab.cache.base.KVCache.truncate`) to what was accepted. Drafts here need no
second model: ``ngram`` is prompt lookup (:mod:`.ngram`)."""

from kvlab.speculative.config import METHODS, SpecConfig

__all__ = ["METHODS", "SpecConfig"]
