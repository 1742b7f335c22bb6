"""Speculative decoding: draft trees, verification, tuning (not yet built: see README status)."""
