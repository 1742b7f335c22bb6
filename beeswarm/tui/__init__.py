"""Textual apps: they render state and send commands; networking and models live elsewhere.

chat_app.py: `beeswarm chat` (and `beeswarm demo`, with the swarm beside the conversation).
dashboard_app.py: `beeswarm contribute` on a terminal, rendering `Contributor.status()`.
widgets/: one widget per file. *.tcss: each app's stylesheet.
"""
