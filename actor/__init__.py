"""worldloop actor."""
