#!/usr/bin/env bash
# Forced command of rayfleet's dedicated cluster SSH key (authorized_keys `command="..."`).
#
# Why it exists: `ray down` runs a hard-coded `ray stop` on the head over SSH, and Ray's
# `ray stop` kills every Ray process on that machine by name — including other people's
# clusters on a shared machine. Ray offers no config key to change that command, so the key
# that `ray up`/`ray down` use for this cluster is bound to this gate, which runs every command
# Ray sends (rsync, mkdir, the start commands, ...) unchanged, except that inside it:
#   ray stop ...   -> rayfleet node stop ...   (stops only the nodes `rayfleet node start` started
#                                               on this machine for the cluster that has a node at
#                                               the address Ray connected to, by their recorded
#                                               sessions)
#   ray / rayfleet -> the given environment's executables (a login shell resets PATH).
# Both are exported shell functions, which bash looks up before PATH and which survive the
# `bash --login -c -i` wrapper Ray puts around each command.
#
# Usage (written by scripts/loopback_ssh.sh):
#   command="/path/to/rayfleet_ssh_gate.sh /path/to/venv/bin" ssh-ed25519 AAAA... rayfleet-cluster
set -u
RAYFLEET_BIN_DIR="${1:?usage: rayfleet_ssh_gate.sh BIN_DIR (holding ray and rayfleet)}"
export RAYFLEET_BIN_DIR
ray() {
    if [ "${1-}" = "stop" ]; then
        shift
        "$RAYFLEET_BIN_DIR/rayfleet" node stop "$@"
    else
        "$RAYFLEET_BIN_DIR/ray" "$@"
    fi
}
rayfleet() { "$RAYFLEET_BIN_DIR/rayfleet" "$@"; }
export -f ray rayfleet
if [ -z "${SSH_ORIGINAL_COMMAND-}" ]; then
    exec bash --login
fi
exec bash -c "$SSH_ORIGINAL_COMMAND"
