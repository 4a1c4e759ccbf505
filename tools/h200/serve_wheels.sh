#!/usr/bin/env bash
# Fetch, into .whl/ of this checkout, the wheels tools/h200/serve.sh installs on the lent GPU machine
# (CPython 3.12, x86-64 Linux; the image has torch, numpy, protobuf, psutil, prometheus-client, httpx, click,
# PyYAML, jinja2, filelock, packaging). The set was checked in a bare Python 3.11 venv holding only those
# image packages: Ray Serve started there with this set (2026-12-01). Run from the repository root before calling the device tool with
# carry [".whl"]. Ray's wheel (~76 MiB) is over the 64 MiB a device call may carry, so it is repacked
# without ray/jars/ (Ray's Java worker), ray/dashboard/client/ (the web UI's static files; the dashboard
# is off) and ray/rllib/ (never imported by Serve): ~41 MiB, the whole set ~54 MiB (~59 MiB with the working tree). Usage:
#   bash tools/h200/serve_wheels.sh [PYTHON_VERSION]     (default 3.12; 3.11 to try the same set here)
set -euo pipefail
py=${1:-3.12}
abi=cp${py/./}
top=$(git rev-parse --show-toplevel)
cd "$top"
exclude=$(git rev-parse --git-common-dir)/info/exclude
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl && mkdir -p .whl
pkgs=(
  ray==2.60.0 grpcio==1.85.3 msgpack==1.2.4
  jsonschema==4.25.1 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0 attrs==25.4.0
  requests==2.32.5 urllib3==2.6.3 charset-normalizer==3.4.4 certifi idna
  grpcio-reflection==1.85.1
  fastapi==0.165.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 starlette==1.10.0
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
  typing-inspection==0.4.2 typing-extensions uvicorn==0.54.0 python-multipart==0.0.20
  diffrp-nvdiffrast==0.3.3.1 trimesh==4.5.3
  fastapi-offline==1.7.7 orjson==3.10.18
)
# The server extra's other packages are not carried: python -m server (serve_bench's single-process
# baseline) refuses to start without fastapi-offline and orjson only; uvloop / httptools are optional for uvicorn
# (asyncio + h11 stand in, for both servers alike), websockets is the stream client's, and
# fast-simplification is imported only for uploads with simplify=true.
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp --abi "$abi" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$p" 2>/dev/null \
    || echo "warning: could not fetch $p" >&2
done
# Repack ray without those folders (the wheel's RECORD lists them: drop those lines too, pip checks RECORD).
python3 - <<'PY'
import glob, zipfile, os
src = glob.glob(".whl/ray-*.whl")[0]
dropped = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/")
tmp = src + ".tmp"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for item in zin.infolist():
        if item.filename.startswith(dropped):
            continue
        data = zin.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"\n".join(line for line in data.split(b"\n") if not line.decode().startswith(dropped))
        zout.writestr(item, data)
os.replace(tmp, src)
PY
du -sh .whl >&2
ls -la .whl >&2
