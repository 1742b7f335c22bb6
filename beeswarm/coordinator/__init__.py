"""Planning who hosts which layers."""
