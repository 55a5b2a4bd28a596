"""Which machine and device this is: the key a catalog keeps its measured rates under.

Seconds predicted from bytes are only as good as the rates they are divided
by, and rates belong to one machine (its disk, its cores) and one compute
device. The key is the hostname, the number of CPUs and the device's name
(``cpu``, or ``cuda:`` and the GPU's name), so two machines sharing a
catalog file keep their own rates, and a GPU run never uses CPU compute
rates. Naming a CUDA device needs torch; nothing else here does, so the
light commands (``explain``) never load it.
"""

from __future__ import annotations

import os
import socket

from mergepipe.errors import ConfigError


def device_label(device: str) -> str:
    """``cpu``, or ``cuda:<GPU name>`` for ``cuda``/``cuda:N`` (ConfigError when there is no such GPU)."""
    if device == "cpu":
        return "cpu"
    if device != "cuda" and not device.startswith("cuda:"):
        raise ConfigError(f"--device must be cpu or cuda, got {device!r}")
    import torch  # only a GPU's name needs torch; the CPU path stays light

    if not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
    return f"cuda:{torch.cuda.get_device_name(index)}"


def machine_key(device: str = "cpu") -> str:
    """``hostname/N cpus/device name``: the rows of measured rates that apply to a run on ``device`` here."""
    return f"{socket.gethostname()}/{os.cpu_count() or 1} cpus/{device_label(device)}"
