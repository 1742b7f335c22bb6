"""Speculative decoding: a local draft proposes token trees, the swarm verifies each in one pass.

tuner.py (pure cost model and shape choice) <- tree.py (trees and masks) <- verify.py <- draft.py
(the draft model) <- decode.py (the round loop the chat client runs).
"""
