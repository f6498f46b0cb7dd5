"""The Redis contract: every key name (``keyspace``), the msgpack codecs of what is kept
there (``codecs``, ``task_record``), the Lua scripts (``scripts``), a cluster's first
write (``bootstrap``), the event log (``eventlog``), who holds which results
(``holdings``), and the clients every role opens (``connection``, ``urls``), with what
they do when Redis refuses (``busy``, ``redis_memory``), who may do what (``acl``) and
the scheduler's lease (``lease``).

Every role's driver, the client and the tools import the modules that talk to Redis; the
state machines take ``keyspace`` and ``codecs`` alone (an import contract in
``pyproject.toml`` holds it for the scheduler's, ``tests/test_layers.py`` for the
worker's)."""
