"""Training scripts (to come)."""
