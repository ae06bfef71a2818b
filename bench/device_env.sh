# Source on a GPU machine whose image has torch but not Hydra: installs the wheels carried in
# .whl/ (made by the shared device-wheels.sh) into .whl/site and longctx itself (editable, no
# deps). bench/runs.sh sources it.
#   source bench/device_env.sh
# Results record longctx.hardware.code_commit(): where the machine's copy of .git is older than the
# tree it reads "<hash>-dirty"; put LONGCTX_COMMIT=$(git rev-parse --short HEAD) (run here) in the
# command to record the tree's commit instead.
export PYTHONUNBUFFERED=1
if ! python3 -c "import hydra" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target .whl/site .whl/*.whl
  export PYTHONPATH=$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
# The interpreter test process needs numpy < 2.4 (pyproject's test extra; Triton 3.6's interpreter
# turns size-1 arrays into ints, which 2.4 refuses). Offline, it must come as a wheel in .whl/.
python3 -c "import numpy, sys; sys.exit(tuple(map(int, numpy.__version__.split('.')[:2])) >= (2, 4))" ||
  echo "device_env.sh: numpy $(python3 -c 'import numpy; print(numpy.__version__)') is too new for" \
    "the interpreter tests: put a numpy<2.4 wheel for this python in .whl/ (pip download" \
    "--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 'numpy<2.4' -d .whl)" >&2
