"""The peer-to-peer mesh on py-libp2p (not yet built: see README status)."""
