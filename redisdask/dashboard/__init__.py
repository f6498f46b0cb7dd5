"""The web dashboard (``redisdask dashboard``, ``LocalCluster(dashboard_address=...)``):
the cluster's status, task stream, workers alive and dead with their logs, deaths, events
and tasks, in a browser, updating live.  It only reads Redis (``reads.py``), so it runs as
the ``monitor`` ACL role and shows a dead worker's last state and logs as long as Redis
keeps them.  Needs the ``dashboard`` extra: ``pip install 'redisdask[dashboard]'``."""
