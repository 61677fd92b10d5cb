"""Model code: a Llama-style Flax decoder whose KV cache is a flsmem memory (to come)."""
