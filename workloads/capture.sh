#!/usr/bin/env bash
# Runs on a lent H100 (../shared/docs/capture-on-device.md): profiles the workloads of this
# folder with the Nsight Systems 2025.3 that ships inside Nsight Compute, imports and exports
# each capture, and leaves one .tar.xz per capture in $OUT (the .nsys-rep, the SQLite export,
# NVIDIA's `nsys stats` CSVs, the exact commands and versions).
#   bash workloads/capture.sh DEBDIR [WHEELDIR] [STAGES...]
# DEBDIR: the libdw/libelf .deb files QdstrmImporter needs; WHEELDIR: megatron-core and
# platformdirs wheels. STAGES (default all): groups overlap loader moe
set -u
DEBS=$1; WHEELS=${2:-}; shift 2 || shift $#
STAGES=${*:-groups overlap loader moe}
NS=${NS:-/opt/nvidia/nsight-compute/2025.3.1/host/target-linux-x64}
HOSTD=${HOSTD:-/opt/nvidia/nsight-compute/2025.3.1/host/linux-desktop-glibc_2_11_3-x64}
W=/tmp/cap; mkdir -p "$W" /tmp/dw
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=$OUT/capture.log
export PYTHONUNBUFFERED=1
for f in "$DEBS"/*.deb; do dpkg -x "$f" /tmp/dw; done
if [ -n "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl >>"$LOG" 2>&1
fi
{
  echo "== versions"; "$NS/nsys" --version; nvidia-smi -L; "$NS/nsys" export --help
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "cuda", torch.version.cuda)'
} >>"$LOG" 2>&1

# capture NAME SECONDS "NSYS OPTIONS" PROGRAM...
DEADLINE=${DEADLINE:-520}  # seconds: a stage gets at most what is left before it, minus exports

capture() {
  local name=$1 limit=$2 opts=$3; shift 3
  local t0=$SECONDS dir=$W/$name left=$((DEADLINE - SECONDS - 60))
  [ "$left" -gt 30 ] || { echo "== $name skipped: $SECONDS s gone" >>"$LOG"; return 1; }
  [ "$limit" -lt "$left" ] || limit=$left
  mkdir -p "$dir"
  echo "== $name: nsys profile $opts -o $name $*" | tee -a "$LOG" >"$dir/COMMANDS"
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" "$NS/nsys" profile $opts -o "$dir/$name" --force-overwrite true "$@" >>"$LOG" 2>&1
  echo "profile exit $? after $((SECONDS - t0)) s" >>"$LOG"
  if [ ! -f "$dir/$name.nsys-rep" ] && [ -f "$dir/$name.qdstrm" ]; then
    LD_LIBRARY_PATH=/tmp/dw/usr/lib/x86_64-linux-gnu timeout 180 "$HOSTD/QdstrmImporter" -i "$dir/$name.qdstrm" >>"$LOG" 2>&1
    echo "QdstrmImporter -i $name.qdstrm" >>"$dir/COMMANDS"
  fi
  rm -f "$dir/$name.qdstrm"
  [ -f "$dir/$name.nsys-rep" ] || { echo "$name: no report" >>"$LOG"; return 1; }
  timeout 180 "$NS/nsys" export --type sqlite -o "$dir/$name.sqlite" "$dir/$name.nsys-rep" >>"$LOG" 2>&1
  echo "nsys export --type sqlite -o $name.sqlite $name.nsys-rep" >>"$dir/COMMANDS"
  # NCCL's NVTX payload values reach an export only as binary blobs, when nsys is asked to.
  if "$NS/nsys" export --help 2>&1 | grep -q -- --include-blobs; then
    timeout 180 "$NS/nsys" export --type sqlite --include-blobs=true -o "$dir/${name}_blobs.sqlite" "$dir/$name.nsys-rep" >>"$LOG" 2>&1 \
      && echo "nsys export --type sqlite --include-blobs=true -o ${name}_blobs.sqlite $name.nsys-rep" >>"$dir/COMMANDS"
  fi
  for r in cuda_gpu_kern_sum cuda_api_sum nvtx_sum cuda_gpu_mem_time_sum osrt_sum; do
    timeout 60 "$NS/nsys" stats -r "$r" -f csv -o "$dir/${name}" "$dir/$name.sqlite" >/dev/null 2>&1
  done
  echo "nsys stats -r cuda_gpu_kern_sum,cuda_api_sum,nvtx_sum,cuda_gpu_mem_time_sum,osrt_sum -f csv" >>"$dir/COMMANDS"
  for db in "$dir"/*.sqlite; do python3 - "$db" >>"$LOG" 2>&1 <<'PY'
import sqlite3, sys
print(sys.argv[1])
con = sqlite3.connect(sys.argv[1])
tables = [r[0] for r in con.execute("select name from sqlite_master where type='table'")]
def n(t):
    try: return con.execute(f"select count(*) from {t}").fetchone()[0]
    except Exception as e: return str(e)
print({t: n(t) for t in tables if n(t)})
for col in ("binaryData", "jsonText", "uint64Value", "int64Value"):
    try: print(col, con.execute(f"select count({col}) from NVTX_EVENTS").fetchone())
    except Exception as e: print(col, e)
PY
  done
  (cd "$W" && tar -cJf "$OUT/$name.tar.xz" "$name")
  ls -la "$OUT/$name.tar.xz" >>"$LOG"
  echo "$name done after $((SECONDS - t0)) s" >>"$LOG"
}

BASIC="-t cuda,nvtx -s none --cpuctxsw=none --cuda-memory-usage=true"
for stage in $STAGES; do
  case $stage in
    groups)  capture nccl_groups 120 "$BASIC" python3 workloads/nccl_groups.py --mode groups ;;
    overlap) capture nccl_overlap 120 "$BASIC" python3 workloads/nccl_groups.py --mode overlap ;;
    loader)  capture slow_loader 180 "-t cuda,nvtx,osrt --sample=cpu --python-sampling=true --cpuctxsw=process-tree" python3 workloads/slow_loader.py ;;
    moe)     PYTHONPATH=/tmp/site capture moe_megatron 170 "$BASIC" python3 workloads/moe_megatron.py ;;
  esac
done

# traceclf's own .nsys-rep path with the real nsys: export_report runs `nsys export` into its
# cache and stamps the file (the analysis itself needs polars, which is too large to carry).
# TRACECLF_SRC: the traceclf package folder to take ingest/nsys.py from (default: this tree).
rep=$(ls "$W"/nccl_groups/*.nsys-rep 2>/dev/null | head -1)
if [ -n "$rep" ]; then
  mkdir -p /tmp/e2e && cp "$rep" /tmp/e2e/ && rep=/tmp/e2e/$(basename "$rep")  # no export beside it
  PYTHONPATH=/tmp/site python3 - "$rep" "$NS/nsys" >>"$LOG" 2>&1 <<'PY'
import os, sys, types, time
from pathlib import Path
pkg = types.ModuleType("traceclf"); pkg.__path__ = [os.environ.get("TRACECLF_SRC", "traceclf")]; sys.modules["traceclf"] = pkg
from traceclf.ingest.nsys import export_report
t = time.time()
out = export_report(Path(sys.argv[1]), nsys=Path(sys.argv[2]), cache_dir=Path("/tmp/tccache"))
print("traceclf export_report ->", out, out.stat().st_size, "bytes in", round(time.time() - t, 1), "s")
again = export_report(Path(sys.argv[1]), nsys=Path(sys.argv[2]), cache_dir=Path("/tmp/tccache"))
print("second call reuses it:", again == out)
PY
  # parquetdir: the same capture as nsys's other columnar export, for a reader test
  mkdir -p "$W/pq"  # nsys creates the folder itself, not its parent
  timeout 120 "$NS/nsys" export --type parquetdir --include-blobs=true -o "$W/pq/nccl_groups" "$rep" >>"$LOG" 2>&1
  (cd "$W/pq" 2>/dev/null && tar -cJf "$OUT/nccl_groups_parquetdir.tar.xz" .) && ls -la "$OUT/nccl_groups_parquetdir.tar.xz" >>"$LOG"
fi
echo "== all done after $SECONDS s" >>"$LOG"
