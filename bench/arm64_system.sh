#!/usr/bin/env bash
# A Debian arm64 system on this x86 machine, for the device agent on the processor of a Raspberry Pi (issue 44).
#
#     sudo bash bench/arm64_system.sh            # build once (cached), install the device agent from this tree
#     sudo bash bench/arm64_system.sh run CMD... # run CMD inside it (chroot + qemu-aarch64), e.g. `protofl-edge --help`
#     sudo bash bench/arm64_system.sh refresh    # re-install this tree's protofl-edge (no dependencies) in both venvs
#
# What it does (root is needed for binfmt_misc, mmdebstrap and chroot):
#   1. apt-get installs mmdebstrap, qemu-user-static and binfmt-support where missing; mounts binfmt_misc
#      (mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc) and enables qemu-aarch64, registered with
#      the F flag (the interpreter is opened at registration, so it works inside the chroot without a copy).
#   2. mmdebstrap builds Debian bookworm arm64 (python3 3.11, venv, pip, dataset-fashion-mnist) from
#      deb.debian.org into $PROTOFL_ARM64_ROOT (default /var/cache/protofl/arm64), once: a finished system
#      carries $ROOT/.protofl-ready and is reused.
#   3. Two virtual environments inside it, each from this tree's source copied to /opt/protofl/src, each taking
#      PyPI's aarch64 wheels (the host's pip configuration is not copied in):
#        /opt/protofl/device: pip install torch==2.13.0, then pip install '/opt/protofl/src[device]'
#                             Measured (issue 44): PyPI's aarch64 torch 2.13.0 wheel is NOT a CPU build: it pulls
#                             nvidia-*-cu13 packages and triton (a 4.6 GB venv). Where download.pytorch.org is
#                             reachable, take its CPU build: PROTOFL_ARM64_TORCH='torch==2.13.0 --index-url
#                             https://download.pytorch.org/whl/cpu' (this machine could not reach it).
#        /opt/protofl/onnx:   pip install '/opt/protofl/src[onnx]' (predict, no torch)
#      and records their installed sizes in $ROOT/opt/protofl/sizes.txt.
#   `run` mounts /proc, /dev, /tmp of the host (a federation's files and the host's server are reachable: the
#   chroot shares the host's network), writes a fake /sys CPU description (see fake_sys) and puts the two venvs'
#   bin on PATH (device first).
#   A build interrupted after a venv was complete resumes from the next step (a venv counts as complete once its
#   protofl-edge script exists).
# Everything under emulation is slow (each aarch64 instruction translated by qemu): run it with `nice`.
# Used by bench/bench_arm64.py (bench/results/ARM64.md) and tests/edge_agent/test_arm64.py (skips without it).
set -euo pipefail
ROOT=${PROTOFL_ARM64_ROOT:-/var/cache/protofl/arm64}
SUITE=${PROTOFL_ARM64_SUITE:-bookworm}
MIRROR=${PROTOFL_ARM64_MIRROR:-http://deb.debian.org/debian}
TORCH=${PROTOFL_ARM64_TORCH:-torch==2.13.0}
SRC=$(cd "$(dirname "$0")/.." && pwd)

need_root() { [ "$(id -u)" = 0 ] || { echo "arm64_system.sh: run as root (binfmt_misc, mmdebstrap, chroot)" >&2; exit 2; }; }

binfmt() {
  local missing=()
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  [ -e /usr/bin/qemu-aarch64-static ] || missing+=(qemu-user-static)
  command -v update-binfmts >/dev/null || missing+=(binfmt-support)
  if [ ${#missing[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
  fi
  [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    update-binfmts --enable qemu-aarch64 2>/dev/null || true
  fi
  if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then  # no binfmt-support entry: register it ourselves
    printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F' \
      >/proc/sys/fs/binfmt_misc/register
  fi
  grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 || {
    echo "arm64_system.sh: qemu-aarch64 is registered without the F flag; it would not run inside the chroot" >&2
    exit 2
  }
}

mounted=()
mount_all() {
  for d in proc dev tmp; do
    if ! mountpoint -q "$ROOT/$d"; then
      mount --bind "/$d" "$ROOT/$d"
      mounted+=("$ROOT/$d")
    fi
  done
  fake_sys
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  # pip inside verifies TLS with the host's CA bundle (a host behind a TLS-inspecting proxy trusts its CA there)
  cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/protofl-host-ca.crt"
}
# The host's /sys is NOT bind-mounted: torch's oneDNN (xbyak) reads the CPU's MIDR_EL1 from
# /sys/devices/system/cpu/cpu*/regs/identification/midr_el1, which qemu-user cannot provide (the host's /sys
# describes x86 CPUs), and `import torch` dies ("Can't open MIDR_EL1 sysfs entry", then SIGSEGV). The guest gets
# a small fake CPU description instead, a Raspberry Pi 4's: 4 Cortex-A72 cores (MIDR 0x410fd083), and the
# possible/present/online lists that cpuinfo parses.
fake_sys() {
  local cpu=$ROOT/sys/devices/system/cpu i
  if mountpoint -q "$ROOT/sys"; then umount -l "$ROOT/sys"; fi # a bind mount left by an older version of this script
  for i in 0 1 2 3; do
    mkdir -p "$cpu/cpu$i/regs/identification"
    echo 0x00000000410fd083 >"$cpu/cpu$i/regs/identification/midr_el1"
  done
  for f in possible present online; do echo 0-3 >"$cpu/$f"; done
}
umount_all() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" || true; done
  mounted=()
}
trap umount_all EXIT

in_root() {  # a command inside the arm64 system, with the device venv first on PATH
  chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PIP_CERT=/etc/protofl-host-ca.crt \
    PATH=/opt/protofl/device/bin:/opt/protofl/onnx/bin:/opt/protofl/lite/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    ${PROTOFL_ARM64_ENV:-} "$@"
}

copy_src() {
  rm -rf "$ROOT/opt/protofl/src"
  mkdir -p "$ROOT/opt/protofl/src"
  (cd "$SRC" && git ls-files -z --cached --others --exclude-standard \
    | grep -zv '^bench/results/' | tar --null -T - -cf -) | tar -xf - -C "$ROOT/opt/protofl/src"
}

build() {
  if [ -e "$ROOT/.protofl-ready" ]; then
    echo "arm64 system ready at $ROOT (remove $ROOT/.protofl-ready to rebuild it)"
    return
  fi
  if [ ! -e "$ROOT/.protofl-base" ]; then
    rm -rf "$ROOT"
    mkdir -p "$(dirname "$ROOT")"
    mmdebstrap --arch=arm64 --variant=apt \
      --include=python3,python3-venv,python3-pip,ca-certificates,dataset-fashion-mnist,procps \
      "$SUITE" "$ROOT" "$MIRROR"
    touch "$ROOT/.protofl-base"
  fi
  mount_all
  copy_src
  local t0=$SECONDS
  local resumed=
  if [ -e "$ROOT/opt/protofl/device/bin/protofl-edge" ]; then
    resumed=device
  else
    in_root python3 -m venv /opt/protofl/device
    # shellcheck disable=SC2086  # $TORCH may carry pip options (--index-url ...)
    in_root /opt/protofl/device/bin/pip install --no-cache-dir -q $TORCH
    in_root /opt/protofl/device/bin/pip install --no-cache-dir -q '/opt/protofl/src[device]'
  fi
  if [ ! -e "$ROOT/opt/protofl/onnx/bin/protofl-edge" ]; then
    in_root python3 -m venv /opt/protofl/onnx
    in_root /opt/protofl/onnx/bin/pip install --no-cache-dir -q '/opt/protofl/src[onnx]'
  fi
  {
    echo "install_s $((SECONDS - t0))"
    if [ -n "$resumed" ]; then echo "resumed $resumed"; fi  # install_s then times the onnx venv alone
    for v in device onnx; do
      echo "$v $(du -sb "$ROOT/opt/protofl/$v" | cut -f1)"
    done
    echo "torch $(du -sb "$ROOT"/opt/protofl/device/lib/python3*/site-packages/torch | cut -f1)"
    # not /opt (the venvs above) nor the host's directories bind-mounted into it
    echo "base_system $(du -sb --exclude="$ROOT/opt" --exclude="$ROOT/proc" --exclude="$ROOT/dev" \
      --exclude="$ROOT/tmp" "$ROOT" | cut -f1)"
  } >"$ROOT/opt/protofl/sizes.txt"
  in_root /opt/protofl/device/bin/pip freeze >"$ROOT/opt/protofl/device.freeze"
  in_root /opt/protofl/onnx/bin/pip freeze >"$ROOT/opt/protofl/onnx.freeze"
  in_root python3 -c 'import platform; print(platform.machine())' | grep -qx aarch64
  touch "$ROOT/.protofl-ready"
  echo "arm64 system ready at $ROOT:"
  cat "$ROOT/opt/protofl/sizes.txt"
}

lite() {  # the base system and the lite venv alone (issue 57: no torch), where the torch venv is not wanted
  if [ ! -e "$ROOT/.protofl-base" ]; then
    rm -rf "$ROOT"
    mkdir -p "$(dirname "$ROOT")"
    mmdebstrap --arch=arm64 --variant=apt \
      --include=python3,python3-venv,python3-pip,ca-certificates,dataset-fashion-mnist,procps \
      "$SUITE" "$ROOT" "$MIRROR"
    touch "$ROOT/.protofl-base"
  fi
  mount_all
  copy_src
  local t0=$SECONDS
  if [ ! -e "$ROOT/opt/protofl/lite/bin/protofl-edge" ]; then
    in_root python3 -m venv /opt/protofl/lite
    in_root /opt/protofl/lite/bin/pip install --no-cache-dir -q '/opt/protofl/src[lite]'
  fi
  {
    echo "install_s $((SECONDS - t0))"
    echo "lite $(du -sb "$ROOT/opt/protofl/lite" | cut -f1)"
  } >"$ROOT/opt/protofl/lite-sizes.txt"
  in_root /opt/protofl/lite/bin/pip freeze >"$ROOT/opt/protofl/lite.freeze"
  in_root python3 -c 'import platform; print(platform.machine())' | grep -qx aarch64
  echo "arm64 lite venv ready at $ROOT/opt/protofl/lite:"
  cat "$ROOT/opt/protofl/lite-sizes.txt"
}

# One compound command ending in exit: bash reads it whole before running it, so editing this file while a long
# run is under way cannot make bash read on at a shifted offset once it ends.
{
need_root
binfmt
case "${1:-build}" in
  build) build ;;
  lite) lite ;;  # the lite device's venv only: sudo bash bench/arm64_system.sh lite
  refresh)
    [ -e "$ROOT/.protofl-ready" ] || { echo "no arm64 system at $ROOT: run bench/arm64_system.sh first" >&2; exit 2; }
    mount_all
    copy_src
    for v in device onnx; do
      in_root /opt/protofl/$v/bin/pip install --no-cache-dir -q --no-deps --force-reinstall /opt/protofl/src
    done
    ;;
  run)
    shift
    [ -e "$ROOT/.protofl-ready" ] || [ -e "$ROOT/opt/protofl/lite/bin/protofl-edge" ] || { echo "no arm64 system at $ROOT: run bench/arm64_system.sh (or its lite) first" >&2; exit 2; }
    mount_all
    in_root "$@"
    ;;
  *) echo "usage: arm64_system.sh [build | refresh | run CMD...]" >&2; exit 2 ;;
esac
exit
}
