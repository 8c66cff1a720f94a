"""Prometheus exposition shared by the engine's collector and the worker's. Imports
prometheus_client: never imported by the proxy."""
