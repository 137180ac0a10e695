#!/usr/bin/env bash
# Issue 64's checks on a lent accelerator machine, as one prepared command: the small
# and large steps against a plain process and a raw pyzmq server (accelerator_check.py),
# where a step's time goes on the host (step_anatomy.py), and `return x` against raw
# (`colobus bench calls`). Everything lands in $OUT (the device tool brings it back);
# each part has its own time limit, and one failing does not stop the others.
#
# The lent machines lack pyzmq (the TPU also msgpack and cloudpickle): carry them as
# wheels in an ignored folder. Once, here, in the repository's root (the H200's Python
# is 3.12; the TPU's 3.11: use --python-version 3.11 and add msgpack and cloudpickle):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl pyzmq==27.3.0
#
# then run `bash benchmarks/on_device.sh` there, carrying `.whl`, with a timeout of
# about 540 s. QUICK=1 makes it a smoke run (what to try here first, on CPU).
set -u
OUT=${OUT:-/tmp/colobus-on-device}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
QUICK_FLAG=""
[ "${QUICK:-0}" = 1 ] && QUICK_FLAG="--quick"

part() {  # part NAME SECONDS COMMAND...: its output in $OUT/NAME.log, its status in the log
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%T))" | tee -a "$OUT/summary.log"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "   exit $?" | tee -a "$OUT/summary.log"
}

{ nvidia-smi -L 2>/dev/null; $PY -c 'import jax; print(jax.__version__, jax.devices())'; } \
    > "$OUT/machine.log" 2>&1
part accelerator_check 300 $PY benchmarks/accelerator_check.py $QUICK_FLAG \
    --out "$OUT/accelerator_check.json"
part step_anatomy 120 $PY benchmarks/step_anatomy.py --kind mlp --steps 400
part bench_calls 90 $PY -m colobus bench calls --quick --no-peers
tail -n 3 "$OUT"/*.log
