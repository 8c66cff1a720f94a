"""Prometheus exposition shared by the engine's collector and the worker's: metric
families declared as a table and the one collector that walks it (:mod:`.families`),
and the scrape server no client can hold (:mod:`.serve`). Imports prometheus_client:
never imported by the proxy. The collectors themselves sit with the records they read
(``engine/observe/metrics.py``, ``worker/metrics.py``), so this part stays below both."""
