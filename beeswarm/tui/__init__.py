"""Textual apps: they render state and send commands; networking and models live elsewhere.

chat_app.py: `beeswarm chat` (and `beeswarm demo`, with the swarm beside the conversation).
widgets/: one widget per file. chat.tcss: the chat app's stylesheet.
"""
