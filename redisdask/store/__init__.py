"""The Redis contract: every key name (``keyspace``), the msgpack codecs of what is kept
there (``codecs``, ``task_record``), the Lua scripts (``scripts``), a cluster's first
write (``bootstrap``), the event log (``eventlog``), and the clients every role opens
(``connection``), with what they do when Redis refuses (``busy``, ``redis_memory``),
who may do what (``acl``) and the scheduler's lease (``lease``).

Only the state machines' drivers and the tools import the modules that talk to Redis;
the state machines take ``keyspace`` and ``codecs`` alone (an import contract in
``pyproject.toml`` holds it)."""
