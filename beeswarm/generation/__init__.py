"""Decoding over any forward function: sampling and the plain generation loop (torch, no networking)."""
