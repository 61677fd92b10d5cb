"""The evaluation harness behind ``flsmem eval``: models on held-out text, every policy
side by side. The core library never imports it, so ``flsmem`` depends on no model."""
