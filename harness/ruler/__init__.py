"""RULER (Hsieh et al. 2024, arXiv 2404.06654) in-tree, under eviction: ``flsmem ruler``.

* :mod:`.tasks`: the synthetic tasks, generated from a seed and sized to a tokenizer;
* :mod:`.score`: RULER's string-match scores;
* :mod:`.protocols`: the model-facing part: prefill, compress and decode with bounded
  memories under three protocols, and the oracle's table;
* :mod:`.run`: the runner (resumable JSON lines) and the command's arguments;
* :mod:`.report`: the accuracy tables with bootstrap intervals, and the plot.
"""
