"""The engine: host-side request/page/scheduling policy (no JAX) and the device-side runner."""
