#!/usr/bin/env bash
# mmdebstrap customize hook of the lab's nspawn rootfs (roles/lab, lab_host_backend=nspawn):
# what every simulated host shares. Per-host state (hostname, ssh host key, authorized key,
# ListenAddress) is written by the role into each host's overlay, never into this rootfs.
# The rootfs cache key hashes this file: changing it rebuilds the rootfs.
# Usage: nspawn-rootfs-setup.sh ROOT OPS_USER OPS_UID
set -euo pipefail

# Debian packages of the rootfs whose services a lab role enables and starts itself, on the host
# that needs them: roles/monitoring runs Prometheus (prometheus), Alertmanager
# (prometheus-alertmanager) and the node exporter (prometheus-node-exporter) where the inventory
# says. Their postinst enables every unit they ship (a chroot starts none), so a booted host would
# run all three, listening on every address, on every host. Disabled, not masked: the role's
# `systemctl enable --now` must still work. Each must be in lab_nspawn_packages (a missing one
# fails the build: this list and that one are kept together; tests/unit/test_lab_nspawn_monitoring.py).
ROLE_STARTED_PACKAGES=(prometheus prometheus-alertmanager prometheus-node-exporter)

# The systemd units package PKG ships in ROOT (dpkg's file list; PKG:ARCH.list for a Multi-Arch:
# same package), one a line.
package_units() { # ROOT PKG
  local -a lists
  mapfile -t lists < <(compgen -G "$1/var/lib/dpkg/info/$2.list" || compgen -G "$1/var/lib/dpkg/info/$2:*.list" || true)
  (( ${#lists[@]} )) || { echo "nspawn-rootfs-setup: package $2 is not in the rootfs (lab_nspawn_packages)" >&2; return 1; }
  { grep -hE '^/(usr/)?lib/systemd/system/[^/]+[.](service|socket|timer|path)$' "${lists[@]}" || true; } | xargs -r -n1 basename | sort -u
}

# Disable every unit the packages ship (systemctl --root: the unit files and links of ROOT only,
# no running systemd needed), then refuse a rootfs where one is still enabled, or masked.
disable_package_units() { # ROOT PKG...
  local root=$1 pkg u out units=()
  shift
  for pkg in "$@"; do
    out=$(package_units "$root" "$pkg") || return 1
    [[ -n $out ]] && mapfile -t -O "${#units[@]}" units <<<"$out"
  done
  (( ${#units[@]} )) || return 0
  systemctl --root="$root" --quiet disable "${units[@]}"
  for u in "${units[@]}"; do
    case $(systemctl --root="$root" is-enabled "$u" 2>/dev/null || true) in
      enabled*|masked*) echo "nspawn-rootfs-setup: $u is still enabled, or masked" >&2; return 1 ;;
    esac
  done
}

# Sourced (tests/unit) for its functions only.
if [[ ${BASH_SOURCE[0]} != "$0" ]]; then return 0; fi

root=$1 user=$2 uid=$3

chroot "$root" useradd --create-home --uid "$uid" --shell /bin/bash "$user"
printf '%s ALL=(ALL) NOPASSWD: ALL\n' "$user" >"$root/etc/sudoers.d/90-dsv41-lab"
chmod 0440 "$root/etc/sudoers.d/90-dsv41-lab"

# Host keys are per host (the role generates them and writes the known_hosts file): none shared.
rm -f "$root"/etc/ssh/ssh_host_*
mkdir -p "$root/etc/ssh/authorized_keys"
cat >"$root/etc/ssh/sshd_config.d/10-dsv41-lab.conf" <<'EOF'
# dsv41 lab host: key authentication only, one host key, keys managed by the lab role.
HostKey /etc/ssh/ssh_host_ed25519_key
AuthorizedKeysFile /etc/ssh/authorized_keys/%u
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
UseDNS no
EOF

# dockerd inside a host of this machine (nspawn-lab notes): the netns is the lab's, so no bridge,
# no iptables, and ip_forward is read-only.
mkdir -p "$root/etc/docker"
cat >"$root/etc/docker/daemon.json" <<'EOF'
{"bridge": "none", "iptables": false, "ip6tables": false, "ip-masq": false, "ip-forward": false}
EOF

# Each host gets its own machine id at first boot (an empty file makes systemd generate one).
: >"$root/etc/machine-id"
# Units that only fail inside a container of this machine.
chroot "$root" systemctl mask systemd-networkd-wait-online.service getty@tty1.service >/dev/null 2>&1 || true
# Installed, not running: roles/monitoring enables and starts them where they belong.
disable_package_units "$root" "${ROLE_STARTED_PACKAGES[@]}"
