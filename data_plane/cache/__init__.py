"""Cache nodes and their client: ``model`` (the wire contract both sides import: transcripts, versions,
ids), ``node`` (the cache node process, ``switchboard cache-node``) with its ``storage``, and ``client``
(the gateway's side: replicas, reads and appends); a node never imports the client.
"""
