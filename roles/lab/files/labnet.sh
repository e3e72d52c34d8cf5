#!/usr/bin/env bash
# Idempotent building blocks of the dsv41 lab's network: the blackhole route, the management
# bridge, each host's network namespace and the direct links (the hosts themselves are nspawn
# machines in those namespaces: nspawnhost.sh).
# Each sub-command converges one piece of state and prints "changed: <what>" for every action it
# took (or would take, with --check); nothing printed = already as wanted. Exit != 0 = error.
# Used by roles/lab (tasks/present.yml, tasks/absent.yml); needs root and iproute2.
set -euo pipefail

CHECK=0
if [[ "${1:-}" == "--check" ]]; then CHECK=1; shift; fi

say() { echo "changed: $*"; }
# run CMD... unless in check mode; always report.
act() { local what=$1; shift; say "$what"; if (( ! CHECK )); then "$@"; fi; }

has_link() { # NS IF  (NS "-" = root namespace)
  if [[ $1 == - ]]; then ip link show dev "$2" >/dev/null 2>&1; else ip -n "$1" link show dev "$2" >/dev/null 2>&1; fi
}
del_link() { ip link del "$1" 2>/dev/null || ! has_link - "$1"; }
ipn() { local ns=$1; shift; if [[ $ns == - ]]; then ip "$@"; else ip -n "$ns" "$@"; fi; }

# Converge MTU, address and up state of IF in NS.
ensure_if() { # NS IF ADDR/PFX MTU
  local ns=$1 dev=$2 cidr=$3 mtu=$4
  if ! ipn "$ns" -o link show dev "$dev" | grep -q " mtu $mtu "; then act "mtu $mtu on $ns/$dev" ipn "$ns" link set dev "$dev" mtu "$mtu"; fi
  if [[ -n $cidr ]] && ! ipn "$ns" -o -4 addr show dev "$dev" | grep -q " inet $cidr "; then
    act "address $cidr on $ns/$dev" ipn "$ns" addr add "$cidr" dev "$dev"
  fi
  if ! ipn "$ns" -o link show dev "$dev" | grep -q "[<,]UP[,>]"; then act "up $ns/$dev" ipn "$ns" link set dev "$dev" up; fi
}

cmd_blackhole() { # CIDR: installed before any lab address so nothing can leave the machine.
  if ! ip route show type blackhole "$1" | grep -q .; then act "blackhole route $1" ip route add blackhole "$1"; fi
}

cmd_bridge() { # NAME ADDR/PFX MTU
  if ! has_link - "$1"; then act "bridge $1" ip link add "$1" type bridge; fi
  if (( CHECK )) && ! has_link - "$1"; then say "address $2 on $1"; return; fi
  ensure_if - "$1" "$2" "$3"
}

cmd_host() { # NS HOSTVETH ADDR/PFX MTU BRIDGE : netns + management veth (mgmt0 inside)
  local ns=$1 veth=$2 cidr=$3 mtu=$4 br=$5
  if [[ ! -e /run/netns/$ns ]]; then act "netns $ns" ip netns add "$ns"; fi
  if (( CHECK )) && [[ ! -e /run/netns/$ns ]]; then say "mgmt0 $cidr in $ns"; return; fi
  if ! has_link "$ns" mgmt0; then
    if has_link - "$veth"; then act "stale $veth" ip link del "$veth"; fi
    act "veth $veth <-> $ns/mgmt0" ip link add "$veth" type veth peer name mgmt0 netns "$ns"
  fi
  if (( CHECK )) && ! has_link "$ns" mgmt0; then return; fi
  if ! ip -o link show dev "$veth" | grep -q "master $br "; then act "$veth on $br" ip link set dev "$veth" master "$br"; fi
  ensure_if - "$veth" "" "$mtu"
  ensure_if "$ns" lo "" 65536
  ensure_if "$ns" mgmt0 "$cidr" "$mtu"
}

cmd_link() { # NS_A IF_A ADDR_A/PFX NS_B IF_B ADDR_B/PFX MTU : a direct point-to-point link
  local na=$1 ia=$2 ca=$3 nb=$4 ib=$5 cb=$6 mtu=$7
  if ! has_link "$na" "$ia" || ! has_link "$nb" "$ib"; then
    # half a pair cannot exist alone (deleting one end deletes the other), but be safe
    if has_link "$na" "$ia"; then act "stale $na/$ia" ip -n "$na" link del "$ia"; fi
    if has_link "$nb" "$ib"; then act "stale $nb/$ib" ip -n "$nb" link del "$ib"; fi
    act "veth $na/$ia <-> $nb/$ib" ip link add "$ia" netns "$na" type veth peer name "$ib" netns "$nb"
  fi
  if (( CHECK )) && ! has_link "$na" "$ia"; then return; fi
  ensure_if "$na" "$ia" "$ca" "$mtu"
  ensure_if "$nb" "$ib" "$cb" "$mtu"
}

cmd_down() { # NS HOSTVETH : kill only processes inside NS, then delete NS and the veth
  local ns=$1 veth=$2 p
  if [[ -e /run/netns/$ns ]]; then
    # SIGKILL: a pid-namespace init ignores SIGTERM.
    for p in $(ip netns pids "$ns"); do act "kill $p in $ns" kill -KILL "$p" 2>/dev/null || true; done
    if (( ! CHECK )); then
      for _ in $(seq 50); do [[ -z $(ip netns pids "$ns") ]] && break; sleep 0.1; done
    fi
    act "netns $ns" ip netns del "$ns"
  fi
  # Deleting the netns destroys its veth peers asynchronously: the root-side end may vanish
  # between the check and the delete, which is the state we want, not an error.
  if has_link - "$veth"; then act "veth $veth" del_link "$veth"; fi
}

cmd_bridge_down() { # NAME CIDR
  if has_link - "$1"; then act "bridge $1" ip link del "$1"; fi
  if ip route show type blackhole "$2" | grep -q .; then act "blackhole route $2" ip route del blackhole "$2"; fi
}

sub=${1:?usage: labnet.sh [--check] blackhole|bridge|host|link|down|bridge-down ARGS}
shift
case $sub in
  blackhole) cmd_blackhole "$@" ;;
  bridge) cmd_bridge "$@" ;;
  host) cmd_host "$@" ;;
  link) cmd_link "$@" ;;
  down) cmd_down "$@" ;;
  bridge-down) cmd_bridge_down "$@" ;;
  *) echo "labnet: unknown sub-command $sub" >&2; exit 2 ;;
esac
