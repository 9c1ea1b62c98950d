#!/usr/bin/env bash
# Packs what a GPU run needs that the GPU machine lacks, inside the checkout and ignored by git (../shared/models.md,
# the device tool's README): .whl/ (the dependency wheels the GPU image lacks, at requirements.txt's versions, for
# CPython 3.12 manylinux; py-spy for serve_profile.sh; the workloads) and .stage/ (each model file in 60 MiB pieces,
# one device call each: `mkdir -p /tmp/stage && mv .stage/* /tmp/stage/`). On the GPU machine, `.whl/join.sh` joins
# the pieces into /tmp/cache (SPECSERVE_CACHE) and checks their sha256.
# Usage: bash benchmarks/gpu_stage.sh [catalog names...]   (default: qwen2.5-coder-1.5b)
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
[ -x "$py" ] || { echo "run ./dev.sh test --co -q first (it sets up .venv)" >&2; exit 2; }
for dir in .whl .stage; do grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude; done
mkdir -p .whl .stage
# the GPU image has torch, numpy, tokenizers, jinja2, tqdm, prometheus-client, pytest (benchmarks/README.md)
wanted="gguf fastapi starlette uvicorn httptools pydantic pydantic-core annotated-types annotated-doc typing-inspection
typing-extensions opentelemetry-api llguidance pyzmq msgspec"
pins=$("$py" -m pip freeze 2>/dev/null)
specs=()
for name in $wanted; do
    pin=$(echo "$pins" | grep -i "^${name//-/[-_]}==" | head -1)
    [ -n "$pin" ] || { echo "no pinned version of $name in .venv" >&2; exit 2; }
    specs+=("$pin")
done
platforms=()
for p in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
         manylinux_2_34 manylinux_2_35 manylinux_2_5 manylinux1; do platforms+=(--platform "${p}_x86_64"); done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "${specs[@]}" py-spy==0.4.3
cp ../shared/workloads/prompts.json .whl/ 2>/dev/null || echo "no ../shared/workloads/prompts.json: serve steps need it" >&2
: > .whl/join.sh
for name in "${@:-qwen2.5-coder-1.5b}"; do
    file=$(.venv/bin/specserve models pull "$name" | tail -1)
    base=$(basename "$file")
    sum=$(sha256sum "$file" | cut -d' ' -f1)
    rm -f ".stage/$base".part*
    split -b 60m -d "$file" ".stage/$base.part"
    cat >> .whl/join.sh <<JOIN
mkdir -p /tmp/cache; [ -f /tmp/cache/$base ] || cat /tmp/stage/$base.part* > /tmp/cache/$base
echo "$sum  /tmp/cache/$base" | sha256sum -c - || exit 1
JOIN
done
ls .stage | sed 's|^|.stage/|'
du -sh .whl
