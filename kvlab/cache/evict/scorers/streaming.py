"""``streaming``: attention sinks + the most recent tokens as a scorer (StreamingLLM, Xiao
et al., arXiv 2309.17453; kvpress's StreamingLLMPress): a token scores its position, so the
policy keeps the newest ones; the ``sinks`` first tokens are protected by the policy."""

from kvlab.cache.evict.scorers.base import Observation, register_scorer


@register_scorer("streaming", sinks=4, kvpress="StreamingLLMPress")
def streaming(obs: Observation):
    return obs.positions.float()
