#!/usr/bin/env bash
# Start Prometheus and Grafana from Homebrew with the expertmesh dashboard provisioned (no Docker).
#   deploy/watch.sh        then open http://localhost:3000 (admin/admin); Ctrl-C stops both.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
for f in prometheus grafana; do
  command -v "$f" >/dev/null || brew list "$f" >/dev/null 2>&1 || brew install "$f"
done
state="${EXPERTMESH_HOME:-$HOME/.cache/expertmesh}/watch"
mkdir -p "$state/prometheus" "$state/grafana"
export PROMETHEUS_URL=http://127.0.0.1:9090
export EXPERTMESH_DASHBOARDS_DIR="$here/grafana/dashboards"
prometheus --config.file="$here/prometheus/prometheus.yml" --storage.tsdb.path="$state/prometheus" \
  --web.listen-address=127.0.0.1:9090 &
prom=$!
grafana_home="$(brew --prefix grafana)/share/grafana"
grafana server --homepath "$grafana_home" \
  cfg:paths.provisioning="$here/grafana/provisioning" cfg:paths.data="$state/grafana" \
  cfg:server.http_addr=127.0.0.1 &
graf=$!
trap 'kill $prom $graf 2>/dev/null; wait' INT TERM EXIT
echo "Prometheus http://127.0.0.1:9090  Grafana http://127.0.0.1:3000 (admin/admin)"
wait
