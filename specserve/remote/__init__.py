"""API remoting: a runner on another machine (or process) that owns the device (protocol, host, client)."""
