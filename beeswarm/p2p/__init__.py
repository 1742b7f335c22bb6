"""The peer-to-peer mesh on py-libp2p: the node (its own trio thread), identity, private-swarm auth,
request/response, channels, membership, link probes, bans and swarm descriptors."""
