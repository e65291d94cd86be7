#!/usr/bin/env bash
# elastrain's one install list: `./dev setup`, the Dockerfile and the launch specs' set-up steps all run this
# script, so what one of them gets, the others get too (tests/unit/test_launch_image.py checks that they call it).
#
#   tools/install.sh VENV EXTRAS [REQUIREMENT...]
#
#   VENV         the virtual environment to install into; made with `python3 -m venv` when it is missing
#   EXTRAS       elastrain's extras, comma-separated: t5,etcd in the image, dev,deepspeed for ./dev ("" for none)
#   REQUIREMENT  more packages, e.g. s3fs for an s3:// checkpoint bucket
#   TORCH_INDEX  (environment) the index torch comes from: https://download.pytorch.org/whl/cpu, .../cu128;
#                unset, pip's own configuration decides
#
# Versions are pinned in constraints.txt. Runs from any directory; VENV is relative to the caller's.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: tools/install.sh VENV EXTRAS [REQUIREMENT...]" >&2
    exit 2
fi
venv=$1
extras=$2
shift 2
case "$venv" in
    /*) ;;
    *) venv="$PWD/$venv" ;;
esac
cd "$(dirname "$0")/.."
export PIP_CONSTRAINT="$PWD/constraints.txt"   # also reaches pip's isolated build environments
export PIP_DISABLE_PIP_VERSION_CHECK=1

[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q -c constraints.txt)

# torch first and on its own: its CPU and CUDA builds share a version and differ by index.
"${pip[@]}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} torch
"${pip[@]}" setuptools wheel
case ",$extras," in
    *,deepspeed,*)
        # DeepSpeed ships an sdist that imports torch to build: build it against the torch above.
        DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation deepspeed
        ;;
esac
"${pip[@]}" -e ".${extras:+[$extras]}" "$@"
