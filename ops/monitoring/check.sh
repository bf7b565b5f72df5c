#!/usr/bin/env bash
# Checks the monitoring files offline with the real promtool (Debian's `prometheus`
# package): the alerting rules parse, their unit tests pass, and every query of the
# dashboard parses as PromQL. That every metric they name exists is checked against a
# live scrape by ops/tests/monitoring.rs (metrics_of_a_cell_with_proxies).
set -euo pipefail
cd "$(dirname "$0")"
command -v promtool >/dev/null || {
  echo "ops/monitoring/check.sh needs promtool: apt-get install -y prometheus" >&2
  exit 1
}
promtool check rules alerts.yml
promtool test rules alerts.test.yml
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Each dashboard query as a recording rule, its $cell variable as a regular expression.
jq -r '.panels[].targets[].expr' dashboard.json |
  sed 's/\$cell/.*/g' |
  awk 'BEGIN { print "groups:\n  - name: dashboard\n    rules:" }
       { gsub(/\047/, "\047\047"); printf "      - record: dashboard:query_%d\n        expr: \047%s\047\n", NR, $0 }' \
  >"$tmp/dashboard-rules.yml"
echo "dashboard.json: $(jq '[.panels[].targets[]] | length' dashboard.json) queries"
promtool check rules "$tmp/dashboard-rules.yml"
