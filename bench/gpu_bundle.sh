#!/usr/bin/env bash
# What bench/gpu.py needs on a lent GPU machine that it lacks, in the ignored folder .gpu-bundle/
# (carry it): Ray and the packages Ray needs that its image lacks, for Python 3.12, unpacked and
# packed as one site.tar.xz (Ray's 79 MB wheel is over the 64 MiB a call may carry: its Java jars,
# RLlib, Serve and the dashboard's web client are left out, ~29 MB packed), and the 10,000 real
# MNIST images. Run here, in the repository root:
#
#   bash bench/gpu_bundle.sh
#
# then on the GPU machine (device tool, carry [".gpu-bundle"]):
#
#   mkdir -p /tmp/site && tar xJf .gpu-bundle/site.tar.xz -C /tmp/site && \
#     PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 bench/gpu.py --mnist-dir .gpu-bundle/mnist
set -euo pipefail
cd "$(dirname "$0")/.."

bundle=.gpu-bundle
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$bundle" && mkdir -p "$bundle" "$work/wheels" "$work/site"

# Ray, and what it needs beyond the GPU image's packages (jsonschema's family, pydantic's,
# tensorboardX for Ray Train and Tune).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work/wheels" \
  ray==2.60.0 jsonschema jsonschema-specifications referencing rpds-py \
  pydantic pydantic-core annotated-types typing-inspection tensorboardX
for wheel in "$work"/wheels/*.whl; do
  unzip -q -o "$wheel" -d "$work/site"
done
rm -rf "$work"/site/ray/jars "$work"/site/ray/rllib "$work"/site/ray/serve \
  "$work"/site/ray/dashboard/client/build
tar cf - -C "$work/site" . | xz -6 -T0 > "$bundle/site.tar.xz"

mkdir -p "$bundle/mnist/MNIST/raw"
cp ../shared/datasets/mnist/MNIST/raw/t10k-*-ubyte.gz "$bundle/mnist/MNIST/raw/"
du -sh "$bundle"
