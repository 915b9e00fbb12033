"""worldloop learner."""
