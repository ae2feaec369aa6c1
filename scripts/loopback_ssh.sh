#!/usr/bin/env bash
# Make 127.0.0.1, 127.0.0.2 and 127.0.0.3 reachable as root by SSH with rayfleet's dedicated
# cluster key, so that `ray up cluster.yaml` (Ray's `local` provider) can treat them as three
# machines. Idempotent; meant for a fresh Debian/Ubuntu machine as root with no human (CI).
#
#   scripts/loopback_ssh.sh [BIN_DIR]
#
# BIN_DIR holds `ray` and `rayfleet` (default: the repository's .venv/bin). Steps:
#   1. install openssh-server and rsync with apt-get if missing (Ray's file mounts use rsync);
#   2. create the key ~/.ssh/rayfleet_cluster_ed25519 (the `auth.ssh_private_key` of cluster.yaml);
#   3. authorize it in ~/.ssh/authorized_keys bound to scripts/rayfleet_ssh_gate.sh, which turns
#      the `ray stop` of `ray down` into `rayfleet node stop` (see that script);
#   4. unless sshd already accepts the key on all three addresses, start a dedicated sshd that
#      listens on those loopback addresses only (config /etc/ssh/sshd_config_rayfleet).
# Exit codes: 0 ready, 3 sshd/rsync could not be installed (callers may skip), 1 other failure.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="$(cd "${1:-$REPO/.venv/bin}" && pwd)"
KEY="${RAYFLEET_SSH_KEY:-$HOME/.ssh/rayfleet_cluster_ed25519}"
GATE="$REPO/scripts/rayfleet_ssh_gate.sh"
ADDRESSES=(127.0.0.1 127.0.0.2 127.0.0.3)
SSHD_CONFIG=/etc/ssh/sshd_config_rayfleet
SSHD_PID=/run/sshd_rayfleet.pid

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
ssh-keygen -A >/dev/null          # host keys, if the package did not make them
mkdir -p /run/sshd && chmod 755 /run/sshd

# 2. The dedicated key.
mkdir -p "$(dirname "$KEY")" && chmod 700 "$HOME/.ssh" "$(dirname "$KEY")"
if [ ! -f "$KEY" ]; then
    ssh-keygen -q -t ed25519 -N "" -C rayfleet-cluster -f "$KEY"
fi
chmod 600 "$KEY"

# 3. Authorize it, bound to the gate (replace an older line for the same key).
chmod 755 "$GATE"
pub="$(cut -d' ' -f1,2 "$KEY.pub")"
line="command=\"$GATE $BIN_DIR\",no-agent-forwarding,no-X11-forwarding $pub rayfleet-cluster"
auth="$HOME/.ssh/authorized_keys"
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
if all_reachable; then
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
    echo "AuthorizedKeysFile .ssh/authorized_keys"
    echo "UsePAM no"
    echo "PidFile $SSHD_PID"
    echo "MaxSessions 64"
    echo "MaxStartups 64:30:128"
    echo "Subsystem sftp internal-sftp"
} > "$SSHD_CONFIG"
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
