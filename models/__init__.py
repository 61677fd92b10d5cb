"""Models whose KV cache is a flsmem memory, and what feeds them.

``decoder`` (the Llama-style ``flax.nnx`` decoder, built on the public attention door
:func:`flsmem.attend`), ``tiny`` (the shipped byte-level decoder), ``smollm2`` (the real
SmolLM2-135M from its GGUF file), ``data`` (the bundled text), ``tasks`` (controlled
recall tasks) and ``generate`` (the serving loop). Installed as ``flsmem.models``.
"""
