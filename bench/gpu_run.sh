#!/usr/bin/env bash
# The GPU tier in one call on a lent device machine (one GPU): the CUDA tests, then bench/gpu.py.
# Everything it prints and writes lands in $OUT (default ./gpu_out): pytest.log, gpu.md, gpu.err,
# code.tgz (Inductor's generated code of every case). Each part runs even if the one before failed.
#   bash bench/gpu_run.sh            # on the device machine: device.run(command="bash bench/gpu_run.sh")
# Its step ratios come from processes minutes apart, and a host-bound GPU step drifts with the machine:
# on the same warm machine, a second call `python3 bench/gpu.py --paired` (about 3 minutes) times both
# systems' steps alternated in one process per case.
set -u
OUT="${OUT:-$PWD/gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py=python3
{ nvidia-smi -L; $py -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'python', sys.version.split()[0])"; } 2>&1 | tee "$OUT/device.txt"
# no registry there: install fxshard from this tree with the image's own setuptools and packages
$py -m pip install -q --no-deps --no-build-isolation . 2>&1 | tail -3
(cd tests && timeout 240 $py -m pytest -q -p no:cacheprovider --import-mode=importlib -k "cuda" test_gpu.py 2>&1) | tee "$OUT/pytest.log" | tail -15
mkdir -p /tmp/gpu_code
GPU_BENCH_CODE_DIR=/tmp/gpu_code timeout "${BENCH_TIMEOUT:-420}" $py bench/gpu.py "$@" > "$OUT/gpu.md" 2> >(tee "$OUT/gpu.err" | grep '^{' >&2)
tar -czf "$OUT/code.tgz" -C /tmp gpu_code
cat "$OUT/gpu.md"
