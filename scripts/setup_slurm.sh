#!/usr/bin/env bash
# Idempotent: installs Slurm (Debian's slurm-wlm: slurmctld, slurmd and the client commands) and
# MUNGE, with a MUNGE key, for the `slurm` tests (tests/slurm). Those tests start a slurmctld and
# one slurmd per simulated host themselves, with a slurm.conf of their own, so no service is
# started here: while apt installs, a policy-rc.d answers "not now" to the packages' init scripts
# (only when none is in place already). Needs root (apt, and the tests need it for network
# namespaces anyway); without root it says so and exits 0, and the tests skip.
# Called by scripts/test.sh in the background.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
  echo "setup_slurm: not root: Slurm is not installed and the slurm tests skip" >&2
  exit 0
fi

have() { command -v "$1" >/dev/null 2>&1; }
if ! { have slurmctld && have slurmd && have sbatch && have munged; }; then
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1
  wait_lock=(-o DPkg::Lock::Timeout=600)  # test.sh runs other set-up scripts that may use apt meanwhile
  for try in 1 2 3; do
    apt-get "${wait_lock[@]}" update -qq && break
    [ "$try" = 3 ] && exit 1
    sleep 10
  done
  apt-get "${wait_lock[@]}" install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

# The key of a munged started the usual way (the package's post-install script usually makes
# one). The tests' cluster makes its own key, socket and munged in its folder: one munged serves
# every simulated host, since its socket is a path on the shared file system.
key=/etc/munge/munge.key
if [ ! -s "$key" ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
fi
chown munge:munge "$key" 2>/dev/null || true
chmod 400 "$key"
slurmctld -V
