#!/usr/bin/env bash
# Idempotent building blocks of the lab's hosts (roles/lab, tasks/nspawn.yml):
# each simulated host is a systemd-nspawn machine booted from one cached rootfs (overlay per host)
# inside the host's network namespace (made by labnet.sh), in its own cgroup directories.
# Like labnet.sh: prints "changed: <what>" for every action taken (or that would be taken with
# --check); nothing printed = already as wanted; exit != 0 = error. Needs root.
# Commands, flags and the failures they avoid: docs/lab.md (from the nspawn-lab notes).
set -euo pipefail

CHECK=0
if [[ "${1:-}" == "--check" ]]; then CHECK=1; shift; fi

say() { echo "changed: $*"; }
act() { local what=$1; shift; say "$what"; if (( ! CHECK )); then "$@"; fi; }
die() { echo "nspawnhost: $*" >&2; exit 1; }

CG_UNIFIED=/sys/fs/cgroup/unified
CG_SYSTEMD=/sys/fs/cgroup/systemd

cmd_rootfs() { # OUT.tar.zst SUITE MIRROR PACKAGES(comma-separated) SETUP OPS_USER OPS_UID LOG
  local out=$1 suite=$2 mirror=$3 pkgs=$4 setup=$5 user=$6 uid=$7 log=$8
  [[ -f $out ]] && return 0
  say "rootfs $out (mmdebstrap $suite: $pkgs; log $log)"
  (( CHECK )) && return 0
  mkdir -p "$(dirname "$out")"
  local tmp=${out%.tar.zst}.partial.tar.zst
  rm -f "$tmp"
  # mmdebstrap writes a .tar.zst directly (compressed by zstd); the hook runs outside the chroot.
  if ! mmdebstrap --variant=minbase --include="$pkgs" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      --customize-hook="bash '$setup' \"\$1\" '$user' '$uid'" \
      "$suite" "$tmp" "$mirror" >"$log" 2>&1; then
    rm -f "$tmp"
    die "mmdebstrap failed; last lines of $log:
$(tail -n 15 "$log")"
  fi
  mv "$tmp" "$out"
}

cmd_base() { # TAR DIR : the read-only lower layer of every host's overlay, extracted once
  local tar=$1 dir=$2
  [[ -f $dir/.dsv41-complete ]] && return 0
  say "base $dir from $tar"
  (( CHECK )) && return 0
  rm -rf "$dir.partial"
  mkdir -p "$dir.partial"
  tar --zstd --numeric-owner --xattrs --xattrs-include='*' -xpf "$tar" -C "$dir.partial"
  touch "$dir.partial/.dsv41-complete"
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
}

cmd_overlay() { # BASE HOSTDIR : HOSTDIR/root = overlay(BASE, HOSTDIR/upper); HOSTDIR/docker for /var/lib/docker
  local base=$1 hd=$2
  if mountpoint -q "$hd/root"; then return 0; fi
  act "directories $hd/{upper,work,root,docker}" mkdir -p "$hd/upper" "$hd/work" "$hd/root" "$hd/docker"
  act "overlay $hd/root" mount -t overlay overlay -o "lowerdir=$base,upperdir=$hd/upper,workdir=$hd/work" "$hd/root"
}

# True when PIDFILE names a live systemd-nspawn process in cgroup CG (ours, not a recycled pid).
nspawn_alive() { # PIDFILE CG
  local pid
  [[ -f $1 ]] || return 1
  pid=$(cat "$1")
  [[ $pid =~ ^[0-9]+$ ]] && (( pid > 1 )) && [[ -e /proc/$pid ]] || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == systemd-nspawn ]] || return 1
  grep -q "^0::/$2\(/\|$\)" "/proc/$pid/cgroup" 2>/dev/null
}

# True when LEADER_PIDFILE names a live systemd that is pid 1 of its own pid namespace, sits in the
# network namespace NS and is the child of our systemd-nspawn (NSPAWN_PIDFILE, in cgroup CG): the
# host's systemd, never a recycled pid.
leader_alive() { # LEADER_PIDFILE NS NSPAWN_PIDFILE CG
  local pid
  [[ -f $1 ]] && nspawn_alive "$3" "$4" || return 1
  pid=$(cat "$1")
  [[ $pid =~ ^[0-9]+$ ]] && (( pid > 1 )) && [[ -e /proc/$pid ]] || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == systemd ]] || return 1
  [[ $(awk '/^PPid:/ {print $2}' "/proc/$pid/status" 2>/dev/null) == "$(cat "$3")" ]] || return 1
  [[ $(awk '/^NSpid:/ {print $NF}' "/proc/$pid/status" 2>/dev/null) == 1 ]] || return 1
  [[ $(stat -L -c %i "/proc/$pid/ns/net" 2>/dev/null) == $(stat -L -c %i "/run/netns/$2" 2>/dev/null) ]]
}

cmd_boot() { # MACHINE NS HOSTDIR LEADER_PIDFILE NSPAWN_PIDFILE CGROUP IMAGES LOG [DIR...]
  # DIR...: controller directories bound read-only at the same path in the machine (lab_nspawn_binds_ro);
  # they live in the machine's mount namespace only, so they go with it (nothing to unmount on down).
  local m=$1 ns=$2 hd=$3 lpf=$4 npf=$5 cg=$6 images=$7 log=$8 leader="" d binds=()
  shift 8
  for d in "$@"; do
    # nspawn's --bind-ro=SRC[:DST[:OPTIONS]]: a ':' would be read as the separator.
    [[ $d == /* && $d != *:* ]] || die "$m: bind $d: not an absolute path without ':'"
    binds+=("--bind-ro=$d")
  done
  if leader_alive "$lpf" "$ns" "$npf" "$cg"; then return 0; fi
  say "boot $m (systemd-nspawn in $ns, cgroup $cg${binds[*]:+; ${binds[*]}})"
  (( CHECK )) && return 0
  [[ -e /run/netns/$ns ]] || die "network namespace $ns missing (labnet.sh host first)"
  mountpoint -q "$hd/root" || die "$hd/root is not mounted (overlay first)"
  for d in "$@"; do [[ -d $d ]] || die "$m: bind $d: no such directory on this machine"; done
  if nspawn_alive "$npf" "$cg"; then die "$m: systemd-nspawn $(cat "$npf") runs without a live host systemd; lab_down first"; fi
  mkdir -p "$CG_UNIFIED/$cg" "$CG_SYSTEMD/$cg" "$images"
  # Its own cgroup directories (both hierarchies) before exec: otherwise every machine's payload
  # lands in one cgroup and the hosts see each other's processes. The flags: docs/lab.md.
  # shellcheck disable=SC2016
  setsid bash -c '
    echo $$ >"$1/cgroup.procs"; echo $$ >"$2/cgroup.procs"
    SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 exec systemd-nspawn -D "$3/root" -b -M "$4" --register=no --keep-unit \
      --network-namespace-path="/run/netns/$5" \
      --capability=CAP_NET_ADMIN,CAP_BPF,CAP_IPC_LOCK --system-call-filter="add_key keyctl request_key bpf" \
      --bind="$3/docker:/var/lib/docker" --bind-ro="$6:/srv/dsv41-lab-images" "${@:7}" --console=passive
  ' nspawn "$CG_UNIFIED/$cg" "$CG_SYSTEMD/$cg" "$hd" "$m" "$ns" "$images" "${binds[@]}" </dev/null >"$log" 2>&1 &
  local npid=$!
  echo "$npid" >"$npf"
  # The leader (the host's systemd, pid 1 of the machine) is a child of the nspawn process.
  for _ in $(seq 200); do
    for leader in $(pgrep -P "$npid" || true); do
      echo "$leader" >"$lpf"
      if leader_alive "$lpf" "$ns" "$npf" "$cg"; then break 2; fi
      leader=""
    done
    [[ -e /proc/$npid ]] || die "$m: systemd-nspawn exited; last lines of $log:
$(tail -n 15 "$log")"
    sleep 0.05
  done
  [[ -n $leader ]] || { rm -f "$lpf"; die "$m: no host systemd under systemd-nspawn $npid after 10 s; see $log"; }
  # Up = the host's systemd has finished booting (running, or degraded with the failed units named).
  local state=""
  for _ in $(seq 120); do
    state=$(nsenter -t "$leader" -a systemctl is-system-running 2>/dev/null || true)
    [[ $state == running || $state == degraded ]] && break
    sleep 0.25
  done
  case $state in
    running) ;;
    degraded) echo "nspawnhost: $m degraded: $(nsenter -t "$leader" -a systemctl --failed --no-legend --plain | awk '{print $1}' | tr '\n' ' ')" >&2 ;;
    *) die "$m: systemd not up after 30 s (state '$state'); see $log" ;;
  esac
}

cmd_poweroff() { # MACHINE NS LEADER_PIDFILE NSPAWN_PIDFILE CGROUP TIMEOUT_S : through the host's own systemd
  local m=$1 ns=$2 lpf=$3 npf=$4 cg=$5 t=$6
  if leader_alive "$lpf" "$ns" "$npf" "$cg"; then
    act "poweroff $m (systemctl poweroff in the host)" nsenter -t "$(cat "$lpf")" -a systemctl poweroff
  fi
  (( CHECK )) && return 0
  local t0=$SECONDS
  for _ in $(seq $((t * 10))); do nspawn_alive "$npf" "$cg" || break; sleep 0.1; done
  if nspawn_alive "$npf" "$cg"; then die "$m: systemd-nspawn $(cat "$npf") still running ${t} s after poweroff"; fi
  echo "$m: powered off in $((SECONDS - t0)) s"
  rm -f "$lpf"
}

cg_procs() { # DIR : every pid in the cgroup subtree DIR
  [[ -d $1 ]] || return 0
  find "$1" -name cgroup.procs -exec cat {} + 2>/dev/null
}

cmd_down() { # MACHINE NS HOSTDIR LEADER_PIDFILE NSPAWN_PIDFILE CGROUP TIMEOUT_S : nothing of the machine left
  local m=$1 ns=$2 hd=$3 lpf=$4 npf=$5 cg=$6 t=$7 p mp
  if nspawn_alive "$npf" "$cg"; then
    if ! ( cmd_poweroff "$m" "$ns" "$lpf" "$npf" "$cg" "$t" ); then echo "nspawnhost: $m: forcing" >&2; fi
  fi
  # Whatever is still in the host's cgroups is a process of this lab host (nothing else was ever
  # put there): cgroup.kill ends the whole subtree (cgroup2), then the v1 name=systemd leftovers.
  if [[ -n $(cg_procs "$CG_UNIFIED/$cg") ]]; then
    act "kill the processes left in cgroup $cg" sh -c "echo 1 >'$CG_UNIFIED/$cg/cgroup.kill'"
  fi
  for p in $(cg_procs "$CG_SYSTEMD/$cg"); do act "kill $p in cgroup $cg" kill -KILL "$p" 2>/dev/null || true; done
  if (( ! CHECK )); then
    for _ in $(seq 50); do [[ -z $(cg_procs "$CG_UNIFIED/$cg")$(cg_procs "$CG_SYSTEMD/$cg") ]] && break; sleep 0.1; done
  fi
  for d in "$CG_UNIFIED/$cg" "$CG_SYSTEMD/$cg"; do
    if [[ -d $d ]]; then act "cgroup $d" find "$d" -depth -type d -exec rmdir {} +; fi
  done
  # Every mount under the host's directory (the overlay; anything below it), deepest first.
  if [[ -d $hd ]]; then
    while read -r mp; do
      [[ -n $mp ]] && act "unmount $mp" umount "$mp"
    done < <(findmnt -rn -o TARGET | grep -E "^$hd(/|$)" | sort -r || true)
  fi
  if [[ -d /run/systemd/nspawn/propagate/$m ]]; then act "/run/systemd/nspawn/propagate/$m" rm -rf "/run/systemd/nspawn/propagate/$m"; fi
  # nspawn's own empty run-time directories (rmdir: never one another machine still uses).
  rmdir /run/systemd/nspawn/propagate /run/systemd/nspawn/locks /run/systemd/nspawn 2>/dev/null || true
  for p in "$lpf" "$npf"; do
    if [[ -f $p ]]; then act "pidfile $p" rm -f "$p"; fi
  done
}

sub=${1:?usage: nspawnhost.sh [--check] rootfs|base|overlay|boot|poweroff|down ARGS}
shift
case $sub in
  rootfs) cmd_rootfs "$@" ;;
  base) cmd_base "$@" ;;
  overlay) cmd_overlay "$@" ;;
  boot) cmd_boot "$@" ;;
  poweroff) cmd_poweroff "$@" ;;
  down) cmd_down "$@" ;;
  *) echo "nspawnhost: unknown sub-command $sub" >&2; exit 2 ;;
esac
