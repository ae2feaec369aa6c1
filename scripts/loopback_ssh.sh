#!/usr/bin/env bash
# Make 127.0.0.1, 127.0.0.2 and 127.0.0.3 reachable as root by SSH with rayfleet's dedicated
# cluster key, so that `ray up cluster.yaml` (Ray's `local` provider) can treat them as three
# machines. Meant for a fresh Debian/Ubuntu machine as root with no human (CI).
#
#   scripts/loopback_ssh.sh [BIN_DIR]                  # persistent setup (a CI box of its own)
#   scripts/loopback_ssh.sh --private DIR [BIN_DIR]    # everything under DIR; the system untouched
#
# BIN_DIR holds `ray` and `rayfleet` (default: the repository's .venv/bin). Steps:
#   1. install openssh-server and rsync with apt-get if missing (Ray's file mounts use rsync);
#   2. create the key ~/.ssh/rayfleet_cluster_ed25519 (the `auth.ssh_private_key` of cluster.yaml);
#   3. authorize it in ~/.ssh/authorized_keys bound to scripts/rayfleet_ssh_gate.sh, which turns
#      the `ray stop` of `ray down` into `rayfleet node stop` (see that script);
#   4. unless sshd already accepts the key on all three addresses, start a dedicated sshd that
#      listens on those loopback addresses only (config /etc/ssh/sshd_config_rayfleet).
#
# --private DIR (what the integration tests use): steps 2-4 write only under DIR — the key
# (DIR/cluster_ed25519), DIR/authorized_keys, the sshd's own host key and DIR/sshd_config — and
# do not start sshd: the caller runs `/usr/sbin/sshd -D -e -f DIR/sshd_config` as its own child
# (so it can stop and reap it on every exit path; a daemonized sshd outlives a crashed caller).
# Nothing in /etc/ssh or ~/.ssh changes. If /run/sshd (sshd's privilege-separation directory)
# had to be created, DIR/created_run_sshd says so, for the caller to remove. With
# RAYFLEET_PROCESS_MARKER set, the sshd passes it on to every session (SetEnv), so processes
# started over SSH can be told apart as the caller's.
# Exit codes: 0 ready, 3 sshd/rsync could not be installed (callers may skip), 1 other failure.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PRIVATE=""
if [ "${1-}" = "--private" ]; then
    PRIVATE="$(mkdir -p "${2:?--private needs a directory}" && cd "$2" && pwd)"
    shift 2
fi
BIN_DIR="$(cd "${1:-$REPO/.venv/bin}" && pwd)"
GATE="$REPO/scripts/rayfleet_ssh_gate.sh"
ADDRESSES=(127.0.0.1 127.0.0.2 127.0.0.3)
if [ -n "$PRIVATE" ]; then
    KEY="$PRIVATE/cluster_ed25519"
    AUTH="$PRIVATE/authorized_keys"
    SSHD_CONFIG="$PRIVATE/sshd_config"
    SSHD_PID="$PRIVATE/sshd.pid"
    HOST_KEY="$PRIVATE/ssh_host_ed25519_key"
else
    KEY="${RAYFLEET_SSH_KEY:-$HOME/.ssh/rayfleet_cluster_ed25519}"
    AUTH="$HOME/.ssh/authorized_keys"
    SSHD_CONFIG=/etc/ssh/sshd_config_rayfleet
    SSHD_PID=/run/sshd_rayfleet.pid
    HOST_KEY=""
fi

log() { echo "loopback_ssh: $*" >&2; }

if [ "$(id -u)" != 0 ]; then
    log "must run as root (it installs packages and authorizes root logins on loopback)"
    exit 1
fi
[ -x "$BIN_DIR/rayfleet" ] || { log "no rayfleet in $BIN_DIR; pass the bin dir of rayfleet's environment"; exit 1; }

# 1. Packages.
if [ ! -x /usr/sbin/sshd ] || ! command -v rsync >/dev/null || ! command -v ssh >/dev/null; then
    if ! command -v apt-get >/dev/null; then
        log "sshd/rsync missing and no apt-get to install them"
        exit 3
    fi
    log "installing openssh-server, openssh-client and rsync"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends \
            openssh-server openssh-client rsync >/dev/null; }; then
        log "apt-get could not install openssh-server/rsync"
        exit 3
    fi
fi
if [ -n "$PRIVATE" ]; then
    rm -f "$HOST_KEY" "$HOST_KEY.pub"
    ssh-keygen -q -t ed25519 -N "" -C rayfleet-loopback-host -f "$HOST_KEY"
else
    ssh-keygen -A >/dev/null      # host keys, if the package did not make them
fi
if [ ! -d /run/sshd ]; then
    mkdir -p /run/sshd
    if [ -n "$PRIVATE" ]; then touch "$PRIVATE/created_run_sshd"; fi
fi
chmod 755 /run/sshd

# 2. The dedicated key.
if [ -z "$PRIVATE" ]; then
    mkdir -p "$(dirname "$KEY")" && chmod 700 "$HOME/.ssh" "$(dirname "$KEY")"
fi
if [ ! -f "$KEY" ]; then
    ssh-keygen -q -t ed25519 -N "" -C rayfleet-cluster -f "$KEY"
fi
chmod 600 "$KEY"

# 3. Authorize it, bound to the gate (replace an older line for the same key).
chmod 755 "$GATE"
pub="$(cut -d' ' -f1,2 "$KEY.pub")"
line="command=\"$GATE $BIN_DIR\",no-agent-forwarding,no-X11-forwarding $pub rayfleet-cluster"
auth="$AUTH"
touch "$auth" && chmod 600 "$auth"
if ! grep -qxF "$line" "$auth"; then
    grep -vF "$pub" "$auth" > "$auth.tmp" || true
    echo "$line" >> "$auth.tmp"
    mv "$auth.tmp" "$auth"
    chmod 600 "$auth"
fi

probe() {  # can we log in to $1 with the key, through the gate?
    ssh -i "$KEY" -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
        -o IdentitiesOnly=yes -o ConnectTimeout=5 -o LogLevel=ERROR "root@$1" \
        'test -n "$RAYFLEET_BIN_DIR"' 2>/dev/null
}
all_reachable() {
    local a
    for a in "${ADDRESSES[@]}"; do probe "$a" || return 1; done
}

# 4. sshd on loopback.
if [ -z "$PRIVATE" ] && all_reachable; then
    log "ready (an sshd already accepts the key on ${ADDRESSES[*]})"
    exit 0
fi
{
    echo "# rayfleet's loopback sshd (scripts/loopback_ssh.sh): key-only root logins on loopback."
    for a in "${ADDRESSES[@]}"; do echo "ListenAddress $a:22"; done
    echo "PermitRootLogin prohibit-password"
    echo "PasswordAuthentication no"
    echo "KbdInteractiveAuthentication no"
    echo "PubkeyAuthentication yes"
    echo "UsePAM no"
    echo "PidFile $SSHD_PID"
    echo "MaxSessions 64"
    echo "MaxStartups 64:30:128"
    echo "Subsystem sftp internal-sftp"
    if [ -n "$PRIVATE" ]; then
        echo "HostKey $HOST_KEY"
        echo "AuthorizedKeysFile $AUTH"
        # DIR usually lies under /tmp (mode 1777), which StrictModes' path check rejects; the
        # files themselves are root's own and mode 600.
        echo "StrictModes no"
        if [ -n "${RAYFLEET_PROCESS_MARKER-}" ]; then
            echo "SetEnv RAYFLEET_PROCESS_MARKER=$RAYFLEET_PROCESS_MARKER"
        fi
    else
        echo "AuthorizedKeysFile .ssh/authorized_keys"
    fi
} > "$SSHD_CONFIG"
if [ -n "$PRIVATE" ]; then
    /usr/sbin/sshd -t -f "$SSHD_CONFIG"
    log "configured under $PRIVATE; start it with: /usr/sbin/sshd -D -e -f $SSHD_CONFIG"
    exit 0
fi
if [ -f "$SSHD_PID" ] && kill -0 "$(cat "$SSHD_PID")" 2>/dev/null; then
    kill -HUP "$(cat "$SSHD_PID")"   # ours is running with an older config: reload it
    sleep 1
else
    /usr/sbin/sshd -t -f "$SSHD_CONFIG"
    /usr/sbin/sshd -f "$SSHD_CONFIG"
fi
for _ in $(seq 1 50); do
    if all_reachable; then
        log "ready (sshd on ${ADDRESSES[*]}, key $KEY)"
        exit 0
    fi
    sleep 0.2
done
log "sshd started but key login to ${ADDRESSES[*]} fails; is another sshd holding port 22? (ss -ltnp)"
exit 1
