#!/usr/bin/env bash
# mmdebstrap customize hook of the lab's nspawn rootfs (roles/lab, lab_host_backend=nspawn):
# what every simulated host shares. Per-host state (hostname, ssh host key, authorized key,
# ListenAddress) is written by the role into each host's overlay, never into this rootfs.
# The rootfs cache key hashes this file: changing it rebuilds the rootfs.
# Usage: nspawn-rootfs-setup.sh ROOT OPS_USER OPS_UID
set -euo pipefail
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
