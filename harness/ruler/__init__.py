"""RULER (Hsieh et al. 2024, arXiv 2404.06654) in-tree: its synthetic long-context
tasks generated from a seed (:mod:`.tasks`) and scored as RULER scores them
(:mod:`.score`)."""
