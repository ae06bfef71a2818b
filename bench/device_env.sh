# Source on a GPU machine whose image has torch but not Hydra: installs the wheels carried in
# .whl/ (made by the shared device-wheels.sh) into .whl/site and longctx itself (editable, no
# deps). bench/runs.sh sources it.
#   source bench/device_env.sh
export PYTHONUNBUFFERED=1
if ! python3 -c "import hydra" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target .whl/site .whl/*.whl
  export PYTHONPATH=$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
