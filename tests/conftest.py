"""Test-wide setup that must happen before JAX is imported.

Multi-device tests run on 8 virtual CPU devices (ARCHITECTURE.md §4.3). XLA reads the flag once,
when the CPU backend starts, so it is set here, before any test module imports JAX. Single-device
code keeps using the first device.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
