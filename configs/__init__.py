"""Config presets, shipped as package data (``worldloop up tiny-sokoban`` finds them by name)."""
