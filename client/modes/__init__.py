"""Approximate reuse modes as plan builders over the layerwise executor.

anchor (KVComm offset correction + entropy gate), multicut (boundary-state
reuse under the W_exact guard), blend (CacheBlend selective recompute), halo
(boundary recompute + KL acceptance). Choosing a mode per span is the
policies' job; running plans is `client.layerwise`'s.
"""
