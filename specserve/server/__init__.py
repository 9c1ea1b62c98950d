"""HTTP server: ASGI app, request schemas, response formats, metrics, the `serve` command."""
