"""The replica of ``bench/gpu_check.py``: on ``GET /report``, what it was given and sees.

* ``given``: its ``CUDA_VISIBLE_DEVICES`` (what corral assigned).
* ``cuda``: the devices the CUDA driver shows this process (``libcuda``: cuInit,
  cuDeviceGetCount, cuDeviceGetUuid). The driver applies ``CUDA_VISIBLE_DEVICES``, so this is
  the check that the replica sees only its own devices.
* ``nvml``: the name of every device NVML lists, by UUID. NVML ignores
  ``CUDA_VISIBLE_DEVICES`` (it lists the whole machine), so it serves to name what CUDA shows.

Standard library plus ``pynvml`` (installed with corral); anything missing is reported, never
fatal.
"""

from __future__ import annotations

import ctypes
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def cuda_devices() -> dict[str, Any]:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return {"error": f"no CUDA driver: {exc}"}
    if lib.cuInit(0) != 0:
        return {"error": "cuInit failed"}
    count = ctypes.c_int()
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return {"error": "cuDeviceGetCount failed"}
    uuids = []
    for ordinal in range(count.value):
        device = ctypes.c_int()
        raw = (ctypes.c_char * 16)()
        if lib.cuDeviceGet(ctypes.byref(device), ordinal) or lib.cuDeviceGetUuid(raw, device):
            return {"error": f"device {ordinal}: no UUID"}
        h = bytes(raw).hex()
        uuids.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    return {"count": count.value, "uuids": uuids}


def nvml_names() -> dict[str, Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        return {"error": f"NVML: {exc}"}
    try:
        names = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            names[uuid.decode() if isinstance(uuid, bytes) else uuid] = (
                name.decode() if isinstance(name, bytes) else name
            )
        return {"names": names}
    finally:
        pynvml.nvmlShutdown()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        report: dict[str, Any] = {"given": os.environ.get("CUDA_VISIBLE_DEVICES")}
        if self.path == "/report":  # not on every probe: cuInit takes a while
            report.update(cuda=cuda_devices(), nvml=nvml_names())
        body = json.dumps(report).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
