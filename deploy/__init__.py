"""Deployment files (supervisord, Prometheus, Grafana), shipped as package data."""
