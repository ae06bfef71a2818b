#!/usr/bin/env bash
# Another Triton on an offline GPU machine whose image has its own (the GPU image: Triton 3.6):
# `make` packs a Triton wheel small enough to carry (from a 286 MB wheel for 3.9.0), `use`
# unpacks it there and puts it ahead of the installed one for this shell.
#   bash bench/triton_bundle.sh make 3.9.0 DIR [PYTHON_VERSION]   # where pip reaches PyPI
#   source bench/triton_bundle.sh use DIR                          # on the GPU machine
#   python3 -m pytest -q -n 16 tests/                              # then as usual
# The bundle, each file xz-compressed: libtriton.so stripped of symbols (500 -> 192 MB, 38 MB
# packed), the rest of the package (6 MB), and, where the wheel has two ptxas (Triton 3.9:
# `ptxas-blackwell`, CUDA 13.4, compiles sm_90+; `ptxas`, CUDA 12.9, the older targets), each in
# a file of its own (11 / 8.6 MB). Carry the files a run needs, each by name, within a call's
# 64 MiB. Left out: the AMD backend, CUPTI, the proton profiler and the plugin test libraries.
# `use` sets TRITON_BACKENDS_IN_TREE=1 (the wheel's entry points name the AMD backend) and takes
# the ptxas files carried this time, whatever an earlier `use` unpacked or exported: without the
# legacy ptxas it points TRITON_PTXAS_PATH at the machine's CUDA ptxas (the sm_80 compiles of
# tests/test_compile_targets.py); without ptxas-blackwell it compiles sm_90 with the legacy one
# (TRITON_PTXAS_BLACKWELL_PATH; BENCHMARKS.md, "Triton 3.9": Hopper prefill 2-5% faster than
# with ptxas-blackwell at D=96 / 128 / 192).
# torch stays the image's.
case ${1:-} in
  make)
    set -euo pipefail
    version=${2:?version}; dir=${3:?directory}; py=${4:-3.12}
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 "triton==$version" -d "$tmp"
    (cd "$tmp" && unzip -q triton-*.whl && rm triton-*.whl)
    t=$tmp/triton
    rm -rf "$t"/backends/amd "$t"/backends/nvidia/lib/cupti* "$t"/_C/libproton.so "$t"/profiler \
      "$t"/instrumentation "$t"/plugins "$t"/FileCheck
    mkdir -p "$dir"
    bin=$t/backends/nvidia/bin
    if [ -e "$bin"/ptxas-blackwell ]; then  # two ptxas: a file each, carried as needed
      for tool in ptxas ptxas-blackwell; do
        xz -T0 -9 -c "$bin/$tool" > "$dir/triton-$version-$tool.xz"
        rm "$bin/$tool"
      done
    fi
    strip --strip-unneeded "$t"/_C/libtriton.so
    xz -T0 -9 -c "$t"/_C/libtriton.so > "$dir/triton-$version-lib.xz"
    rm "$t"/_C/libtriton.so
    (cd "$tmp" && tar cf - triton triton-*.dist-info) |
      xz -T0 -9 > "$dir/triton-$version-rest.tar.xz"
    rm -rf "$tmp"
    ls -l "$dir"/triton-"$version"-*
    ;;
  use)
    dir=${2:?directory}
    rest=$(ls "$dir"/triton-*-rest.tar.xz | tail -n 1)
    version=$(basename "$rest" -rest.tar.xz)
    site=/tmp/$version
    if [ ! -e "$site/triton/_C/libtriton.so" ]; then
      mkdir -p "$site" && tar -xJf "$rest" -C "$site" &&
        xz -dc "$dir/$version-lib.xz" > "$site/triton/_C/libtriton.so" ||
        { echo "triton_bundle.sh: cannot unpack $rest" >&2; return 1 2>/dev/null || exit 1; }
    fi
    bin=$site/triton/backends/nvidia/bin
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} TRITON_BUNDLE_SITE=$site
    export TRITON_BACKENDS_IN_TREE=1
    unset TRITON_PTXAS_PATH TRITON_PTXAS_BLACKWELL_PATH  # from an earlier `use` in this shell
    machine=$(command -v ptxas || ls /usr/local/cuda*/bin/ptxas 2>/dev/null | head -n 1)
    if grep -q ptxas_blackwell "$site"/triton/knobs.py; then
      # Two ptxas, each packed in a file of its own (`make`): exactly the ones carried this time
      # (an earlier `use` on this machine may have unpacked another set into the same site).
      for tool in ptxas ptxas-blackwell; do
        rm -f "$bin/$tool"
        if [ -e "$dir/$version-$tool.xz" ]; then
          xz -dc "$dir/$version-$tool.xz" > "$bin/$tool" && chmod +x "$bin/$tool"
        fi
      done
      if [ ! -e "$bin"/ptxas-blackwell ]; then
        if [ -e "$bin"/ptxas ]; then
          export TRITON_PTXAS_BLACKWELL_PATH=$bin/ptxas
        else
          export TRITON_PTXAS_BLACKWELL_PATH=$machine
        fi
        echo "triton_bundle.sh: no ptxas-blackwell carried: sm_90+ compiles with" \
          "$TRITON_PTXAS_BLACKWELL_PATH"
      fi
    fi
    if [ ! -e "$bin"/ptxas ]; then
      export TRITON_PTXAS_PATH=$machine
      echo "triton_bundle.sh: no legacy ptxas carried: the older targets compile with $machine"
    fi
    python3 -c "import triton; print('triton', triton.__version__, 'from', triton.__file__)"
    ;;
  *)
    echo "usage: bash bench/triton_bundle.sh make VERSION DIR [PYTHON_VERSION]" \
      "| source bench/triton_bundle.sh use DIR" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
