#!/usr/bin/env bash
# Writes the pods' IPs into the mindie-ms-global-ranktable ConfigMap (the job MindIE's gen_global_ranktable.py
# does). Run it after the pods are scheduled and whenever servers are added or removed; the controller re-reads
# the file every rank_table_detecting_seconds (kubelet refreshes ConfigMap volumes within its syncFrequency).
# A server pod annotated mindie-host.io/hardware-type (heterogeneous PD, pd/heterogeneous/) gets that value as
# its hardware_type.
set -euo pipefail
NS=${NAMESPACE:-mindie}
# one line per pod with an IP: "IP<tab>hardware type (may be empty)"
pods() { kubectl -n "$NS" get pods -l "app=$1" -o jsonpath='{range .items[?(@.status.podIP)]}{.status.podIP}{"\t"}{.metadata.annotations.mindie-host\.io/hardware-type}{"\n"}{end}'; }
entries() { local first=1 ip hw; while IFS=$'\t' read -r ip hw; do
  [ -n "$ip" ] || continue
  [ $first = 1 ] || printf ','; first=0
  if [ -n "$hw" ]; then
    printf '{"server_id":"%s","server_ip":"%s","device":[],"hardware_type":"%s"}' "$ip" "$ip" "$hw"
  else
    printf '{"server_id":"%s","server_ip":"%s","device":[]}' "$ip" "$ip"
  fi; done < <(pods "$1"); }
count() { pods "$1" | grep -c . || true; }
table=$(printf '{"version":"1.0","status":"completed","server_group_list":[%s,%s,%s]}' \
  "{\"group_id\":\"0\",\"server_count\":\"$(count mindie-ms-coordinator)\",\"server_list\":[$(entries mindie-ms-coordinator)]}" \
  "{\"group_id\":\"1\",\"server_count\":\"$(count mindie-ms-controller)\",\"server_list\":[$(entries mindie-ms-controller)]}" \
  "{\"group_id\":\"2\",\"server_count\":\"$(count mindie-server)\",\"server_list\":[$(entries mindie-server)]}")
kubectl -n "$NS" create configmap mindie-ms-global-ranktable --from-literal=global_rank_table_file.json="$table" \
  --dry-run=client -o yaml | kubectl apply -f -
