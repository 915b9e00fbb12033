"""worldloop common: config, message schemas, Redis-stream transport, ZeroMQ weights, metrics."""
