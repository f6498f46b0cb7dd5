"""Read-only tools: what ``redisdask status``, ``monitor``, ``inspect`` and the Prometheus
exporter show, all read from Redis (``snapshot`` reads, ``views`` draws).  Nothing here
writes a record the cluster acts on."""
