"""The parameter server's state and its rules, free of any transport: the core layer.

``store.VariableStore`` (variables) and ``table_store.TableStore`` (dynamic
tables) hold shard copies in one ``shards.ShardRegistry`` under one
``shards.MemoryBudget``; replication (``replication.Replicator``), sync
gathering (``sync.StepGatherer``) and saving (``saving.Saver``) are
collaborators the stores are composed of. Imports the contract layer only
(never link, client or serve: tests/contract/test_layers.py); the serve
layer puts it on the wire.
"""
