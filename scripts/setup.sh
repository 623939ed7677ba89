#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv with the CPU build of torch,
# the package with its test extra, and what the tests need from Debian. Sourced by train.sh and test.sh.
# LIGHTNING_GAUDI_DS_DEEPSPEED=0.16.1 sets up .venv-deepspeed-0.16.1 with that DeepSpeed instead (test.sh --deepspeed).
# A script that sourced it has LGDS_SET_UP naming the environment made: a later test.sh or docs.sh in that script (or
# its children) only activates it (.ci/run sets up once, then runs steps side by side without two pips at once).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ -n "${LGDS_SET_UP:-}" ] && [ "$LGDS_SET_UP" = "$(pwd)/.venv${LIGHTNING_GAUDI_DS_DEEPSPEED:+-deepspeed-$LIGHTNING_GAUDI_DS_DEEPSPEED}" ] \
   && [ -x "$LGDS_SET_UP/bin/python" ]; then
  # shellcheck disable=SC1091
  . "$LGDS_SET_UP/bin/activate"
  return 0 2>/dev/null || exit 0
fi
# Open MPI for `lightning-gaudi-ds spawn --use_mpi` and its tests (mpi4py comes with the test extra below).
if ! command -v mpirun >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    { $SUDO apt-get update -qq >/dev/null \
      && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           openmpi-bin libopenmpi-dev >/dev/null; } \
      || echo "setup.sh: Open MPI could not be installed: --use_mpi and its tests need mpirun" >&2
  else
    echo "setup.sh: no mpirun and no apt-get: install Open MPI yourself for --use_mpi and its tests" >&2
  fi
fi
# sshd and pdsh for the multi-node tier (tests/multinode: two hosts as network namespaces, each with its own sshd;
# DeepSpeed's multi-node launch uses pdsh). Without them that tier is skipped, saying why.
if ! { [ -x /usr/sbin/sshd ] && command -v pdsh >/dev/null 2>&1; }; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    { $SUDO apt-get update -qq >/dev/null \
      && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           openssh-server openssh-client pdsh >/dev/null; } \
      || echo "setup.sh: openssh-server/pdsh could not be installed: the multi-node tier will be skipped" >&2
  else
    echo "setup.sh: no sshd/pdsh and no apt-get: the multi-node tier (tests/multinode) will be skipped" >&2
  fi
fi
# SLURM 22.05 and munge for the multi-node tier's SLURM tests (tests/multinode/test_slurm.py: slurmctld and slurmd
# on the two namespace hosts, started by the tests with their own configuration). Their services are not started by
# the install (policy-rc.d, made for it where the machine has none). Without them those tests are skipped, saying why.
if ! { command -v slurmd >/dev/null 2>&1 && command -v slurmctld >/dev/null 2>&1 && command -v sbatch >/dev/null 2>&1 \
       && command -v munged >/dev/null 2>&1; }; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    POLICY=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      POLICY=/usr/sbin/policy-rc.d
      printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null && $SUDO chmod 755 "$POLICY"
    fi
    { $SUDO apt-get update -qq >/dev/null \
      && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           slurmd slurmctld slurm-client munge >/dev/null; } \
      || echo "setup.sh: slurmd/slurmctld/munge could not be installed: the SLURM tests will be skipped" >&2
    if [ -n "$POLICY" ]; then $SUDO rm -f "$POLICY"; fi
  else
    echo "setup.sh: no SLURM and no apt-get: the SLURM tests (tests/multinode/test_slurm.py) will be skipped" >&2
  fi
fi
# libaio for DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload; built with the other ops below).
if [ ! -e /usr/include/libaio.h ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    { $SUDO apt-get update -qq >/dev/null \
      && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libaio-dev >/dev/null; } \
      || echo "setup.sh: libaio-dev could not be installed: NVMe offload (benchmarks/capacity.py) needs it" >&2
  else
    echo "setup.sh: no libaio.h and no apt-get: install libaio-dev yourself for NVMe offload" >&2
  fi
fi
# ccache for DeepSpeed's op builds (torch's JIT build puts it before the compiler when installed; below, and the
# suite's, scripts/test.sh): a build of the same sources again (a new extensions folder, an environment made again)
# takes 7 CPU s instead of 70-110. Without it ops build as before.
if ! command -v ccache >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    { $SUDO apt-get update -qq >/dev/null \
      && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ccache >/dev/null; } \
      || echo "setup.sh: ccache could not be installed: DeepSpeed's ops build without a compiler cache" >&2
  fi
fi
DS_PIN=${LIGHTNING_GAUDI_DS_DEEPSPEED:-}
VENV=.venv${DS_PIN:+-deepspeed-$DS_PIN}
# Everything comes from a hash-locked file (pip --require-hashes), made by `bash scripts/lock.sh` from pyproject.toml's
# requirements with the test, examples and dev extras, plus requirements/pins.in (torch's CPU build, pinned here
# only: the package's own range stays loose for Habana's and CUDA torch). A lock that is missing (a DeepSpeed version
# without one) or older than those requirements stops the set-up before any environment is made.
LOCK=requirements/lock${DS_PIN:+-deepspeed-$DS_PIN}.txt
"$PY" requirements/lockcheck.py "$LOCK"
if [ ! -x "$VENV/bin/pip" ]; then  # pip, not python: a half-made venv (no ensurepip) is made again
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# pip's own failures stop the script (pipefail); only this machine's harmless index-location warnings are hidden.
pipq() { python -m pip install -q "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }
# The lock's files, then the package itself, editable, without resolving anything again. uv installs the lock (its
# parallel downloads and unpacking: about 30 s here against pip's 140 s), itself installed by pip from its hashed
# lines in the lock. uv reads no pip configuration: the machine's find-links (a wheel that lies on disk, as torch's CPU
# build here), CA bundle and time-out are passed on. Bytecode: uv writes none (pip compiles every file it installs:
# 14,000 here, 44 CPU s); the op step below writes it for the 3,800 modules a training process imports (torch,
# Lightning, DeepSpeed, transformers: 9 CPU s), even where PYTHONDONTWRITEBYTECODE is set (as on the machine this was
# written on), so no process compiles them again.
# Where uv fails, pip installs the lock, saying so.
# Once installed, the environment is not installed again while the lock and pyproject.toml it was made from are
# unchanged (their digest, stamped in the environment last), nor its ops built while they are (the op step's stamp,
# and their libraries present): a set-up of a set-up environment takes a fraction of a second instead of 13 s.
made_from=$(cat "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$VENV/.lgds-installed" 2>/dev/null)" != "$made_from" ]; then
  uv_lock=$(mktemp)
  awk '/^uv==/{p=1} p{print} p && !/\\$/{exit}' "$LOCK" > "$uv_lock"
  pipconf() { python -m pip config get "global.$1" 2>/dev/null || true; }
  links="${PIP_FIND_LINKS:-} $(pipconf find-links)"
  uv_args=()
  for link in $links; do uv_args+=(--find-links "$link"); done
  cert=${PIP_CERT:-$(pipconf cert)}  # a CA bundle pip is told to trust (a proxy's): uv trusts it too
  timeout=${PIP_DEFAULT_TIMEOUT:-$(pipconf default-timeout)}
  uv_env=()
  if [ -n "$cert" ]; then uv_env+=("SSL_CERT_FILE=$cert"); fi
  if [ -n "$timeout" ]; then uv_env+=("UV_HTTP_TIMEOUT=$timeout"); fi
  if ! { [ -s "$uv_lock" ] && pipq --require-hashes --no-deps -r "$uv_lock" \
         && env "${uv_env[@]}" python -m uv pip install -q --python "$VENV/bin/python" \
              --require-hashes "${uv_args[@]}" -r "$LOCK"; }; then
    echo "setup.sh: uv could not install $LOCK (above): pip installs it" >&2
    pipq --require-hashes -r "$LOCK"
  fi
  rm -f "$uv_lock"
  pipq --no-deps --no-build-isolation -e .
  echo "$made_from" > "$VENV/.lgds-installed"
fi
# DeepSpeed's C++ ops that it would otherwise JIT-compile on first use (the CPU shm comm op, cpu_adam for
# ZeRO-Offload), built now so a first training run starts as fast as later ones; a no-op once built.
# Without a compiler training still works (plain torch.distributed collectives). Skip: LIGHTNING_GAUDI_DS_SKIP_OP_BUILD=1
# The build goes to the op cache training uses: TORCH_EXTENSIONS_DIR if set, else this environment's own
# (<venv>/torch_extensions/py<ver>_<build>; torch's default is shared by every environment, which then rebuild
# each other's). The package chooses it per build call; nothing needs exporting here.
# async_io (NVMe offload) is not built here: about 6 min on 2 cores and no test uses it. Build it once with
# `lightning-gaudi-ds env --build-ops async_io`; benchmarks/capacity.py builds it before its NVMe trials.
OPS=(deepspeed_shm_comm cpu_adam)
ext=${TORCH_EXTENSIONS_DIR:-$(pwd)/$VENV/torch_extensions}
ops_built() {
  [ "$(cat "$VENV/.lgds-ops" 2>/dev/null)" = "$made_from $ext" ] || return 1
  for op in "${OPS[@]}"; do
    [ -n "$(find "$ext" -maxdepth 3 -path "*/$op/$op.so" -print -quit 2>/dev/null)" ] || return 1
  done
}
if [ "${LIGHTNING_GAUDI_DS_SKIP_OP_BUILD:-0}" != "1" ]; then
  if ! ops_built; then
    # ccache: torch puts it before the compiler where it is installed; its cache in the environment (always writable);
    # the build folder is not part of a compile's key (-g records it, so by default it would be)
    if env -u PYTHONDONTWRITEBYTECODE CCACHE_DIR="${CCACHE_DIR:-$(pwd)/$VENV/ccache}" CCACHE_NOHASHDIR=1 \
         python -m lightning_gaudi_ds env --build-ops "${OPS[@]}"; then
      echo "$made_from $ext" > "$VENV/.lgds-ops"
    else
      echo "setup.sh: DeepSpeed ops not built (see above): training falls back to torch.distributed collectives; ZeRO-Offload needs cpu_adam" >&2
    fi
  fi
  export LGDS_SET_UP="$(pwd)/$VENV"  # set up in full (the ops too): see the top
fi
