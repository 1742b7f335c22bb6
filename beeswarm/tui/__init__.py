"""Textual apps (not yet built: see README status)."""
