"""m3serve: a serving stack for MiniMax-M3."""
