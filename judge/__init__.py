"""worldloop judge."""
