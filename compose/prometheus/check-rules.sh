#!/usr/bin/env bash
# The alert rules checked and unit-tested by Prometheus's own promtool (`make test` runs this):
#   promtool check config  compose/prometheus/prometheus.yml   (the config and the rule files it loads)
#   promtool test rules    compose/prometheus/alerts-test.yml  (each rule: series that fire it, series that must not)
# promtool comes from Debian's `prometheus` package: installed with apt-get when missing and root, as
# compose-test.sh installs docker.io; otherwise the error says what to install.
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)"
if ! command -v promtool >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "check-rules: installing Debian's prometheus package (for promtool) with apt-get ..." >&2
        { apt-get install -y -q --no-install-recommends prometheus || { apt-get update -q &&
            apt-get install -y -q --no-install-recommends prometheus; }; } >/tmp/rollout-bus-apt-prometheus.log 2>&1 ||
            { tail -20 /tmp/rollout-bus-apt-prometheus.log >&2; echo "check-rules: apt-get install prometheus failed" >&2; exit 1; }
    else
        echo "check-rules: no promtool: install Debian's prometheus package (or Prometheus's own release)" >&2
        exit 1
    fi
fi
# prometheus.yml names the rules where the compose service mounts them; check a copy that names them here
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp "$dir/alerts.yml" "$work/alerts.yml"
sed "s|/etc/prometheus/alerts.yml|$work/alerts.yml|" "$dir/prometheus.yml" > "$work/prometheus.yml"
echo "check-rules: $(promtool --version 2>&1 | head -1)"
promtool check config "$work/prometheus.yml"
cd "$dir" && promtool test rules alerts-test.yml
