#!/usr/bin/env bash
# Debian's prometheus (promtool for make test; the lab's Prometheus), prometheus-alertmanager and
# prometheus-node-exporter (roles/monitoring), installed WITHOUT starting their services: a
# temporary policy-rc.d refuses every start during the install (Debian's invoke-rc.d contract),
# and on a systemd machine the units are disabled afterwards, so nothing listens on 0.0.0.0.
# A no-op when all three are installed. Needs root and apt (CI: a fresh Debian 12 as root).
set -euo pipefail
pkgs=(prometheus prometheus-alertmanager prometheus-node-exporter)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "tools/install_prometheus.sh: need root and apt-get to install ${missing[*]} (promtool is needed by make test)" >&2
  exit 1
fi
policy=/usr/sbin/policy-rc.d
backup=""
if [ -e "$policy" ]; then backup=$(mktemp); cp -p "$policy" "$backup"; fi
restore() { if [ -n "$backup" ]; then mv -f "$backup" "$policy"; else rm -f "$policy"; fi; }
trap restore EXIT
printf '#!/bin/sh\n# tools/install_prometheus.sh: no service starts during this install\nexit 101\n' > "$policy"
chmod 755 "$policy"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
  for u in prometheus prometheus-alertmanager prometheus-node-exporter; do
    systemctl disable --now "$u" >/dev/null 2>&1 || true
  done
fi
command -v promtool >/dev/null
