#!/usr/bin/env bash
# One entry point that does its own set-up: ./dev.sh serve [args] | ./dev.sh test [pytest args]
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
stamp="$VENV/.requirements.installed"
if [ ! -x "$VENV/bin/python" ] || ! cmp -s requirements.txt "$stamp"; then
    echo "setting up $VENV ..." >&2
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
    cp requirements.txt "$stamp"
fi
cmd="${1:-serve}"
shift || true
case "$cmd" in
    serve)
        exec "$VENV/bin/specserve" serve "$@"
        ;;
    test)
        "$VENV/bin/specserve" models pull smollm2-135m
        exec "$VENV/bin/python" -m pytest -q "$@"
        ;;
    *)
        echo "usage: ./dev.sh serve|test [args]" >&2
        exit 2
        ;;
esac
