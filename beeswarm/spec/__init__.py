"""Speculative decoding: a local draft proposes token trees, the swarm verifies each in one pass.

tuner.py (pure cost model and shape choice) <- tree.py (trees and masks) <- verify.py <- draft.py
(the draft model) <- speculate.py (the walk, and the steps in flight), with layout.py (pure: where the sent
nodes sit in the stages' KV).
"""
