"""Analyses the rewrites share: proving attention and softmax from primitives, layouts, producer chains, mask structure, and the facts about fused kernels."""
