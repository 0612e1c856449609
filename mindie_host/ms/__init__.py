"""MindIE MS for mindie-host: a Coordinator and a Controller in front of many servers (spec §4).

* :mod:`.coordinator`: the data-plane entry; forwards every API to a server, routes
  (round_robin, cache_affinity, load_balance), limits, retries and aggregates metrics.
* :mod:`.controller`: watches the servers listed in a rank table and pushes the live set to
  the coordinator.
* :mod:`.cluster`: ``mindie-host cluster --servers N`` runs all of it on one machine.
"""
