"""The MindIE MS Deployer (spec §8.3.2): ``mindie-host deployer`` (ms_server's REST API) and ``mindie-host msctl``.

* :mod:`.spec`: ``infer_server.json``, checked key by key;
* :mod:`.config`: ``ms_server.json`` and ``msctl.json``;
* :mod:`.app`: the REST API and the status file;
* :mod:`.target`: what a target does; :mod:`.local` (process groups behind a coordinator, with a draining
  rolling update) and :mod:`.kube` (Deployments, Services and ConfigMaps, :mod:`.manifests`);
* :mod:`.msctl`: the client.
"""
