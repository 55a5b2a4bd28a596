"""Experts on the (fake) Hugging Face Hub: mergekit's download-everything vs MergePipe's planned bytes.

Usage: ``python -m benchmarks.hub_bench [--layout qwen3-0.6b] [--experts 3] [--mb-per-second 50]
[--budget 10%]``

The workload (``workloads.py``: a base and K experts at a real layout) is pushed
to the loopback fake Hub of the tests (``tests/fixtures/fake_hub.py``), in a
process of its own, as ``bench/base`` and ``bench/<expert>``; its CDN (where
every safetensors file is served from, after the Hub's 302) paces each
connection at ``--mb-per-second``, so results depend on the link, not on the
page cache. Both systems are run as users run them, as commands with
``HF_ENDPOINT`` pointing at the fake and an empty Hugging Face cache of their
own, on one mergekit YAML naming the models by Hub id (TIES, density 0.5, bf16):

- ``mergekit-yaml``: mergekit 0.1.5 downloads every repo whole into the cache,
  then merges; run again, it reads its cache;
- ``mergepipe merge --config`` at 100%: the first merge with an empty catalog
  registers the ids (headers only), downloads each model once into the cache
  for the analysis (``analysis/analyze.py``) and merges from the cache;
- ``mergepipe merge --config --budget B`` later on the same machine: a new
  budget (or operator) reads the cache, nothing from the network;
- the same on another machine that shares the analysed catalog (issue 39), with
  an empty cache: the base and only the planned expert blocks cross the network.

Bytes and requests are counted by the fake Hub itself (both hosts); disk is
what the run left on disk (the cache, the output, the catalog and its stores).
The last rows project the 7B x 3 case from the measured rates.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import mergekit_runner
from benchmarks.workloads import ensure_workload
from tests.fixtures.fake_hub import FakeHub

MB = 1_000_000
GB = 1_000_000_000
ORG = "bench"
DENSITY = 0.5
SEVEN_B_BYTES = 15.2 * GB  # a 7B model in bf16 (Qwen2.5-7B: 7.6B parameters)


def _serve(root: Path, names: list[str], rate: int, conn) -> None:
    """The fake Hub's process: serve the models, then answer ``reset``/``stats``/``stop``."""
    hub = FakeHub()
    for name in names:
        hub.add_folder(f"{ORG}/{name}", root / name)
    hub.throttle_bytes_per_s = rate
    with hub:
        conn.send(hub.endpoint)
        while (command := conn.recv()) != "stop":
            log = hub.log
            if command == "reset":
                hub.clear_log()
            conn.send((len(log), sum(r.bytes_sent for r in log)))


class Hub:
    """The fake Hub's process and its counters."""

    def __init__(self, root: Path, names: list[str], rate: int) -> None:
        self._conn, child = multiprocessing.Pipe()
        self._proc = multiprocessing.get_context("fork").Process(target=_serve, args=(root, names, rate, child),
                                                                 daemon=True)
        self._proc.start()
        self.endpoint: str = self._conn.recv()

    def reset(self) -> None:
        self._conn.send("reset")
        self._conn.recv()

    def stats(self) -> tuple[int, int]:
        """(requests, bytes sent) since the last reset."""
        self._conn.send("stats")
        return self._conn.recv()

    def stop(self) -> None:
        self._conn.send("stop")
        self._proc.join(timeout=10)


def _disk(*paths: Path) -> int:
    """Bytes of the files under ``paths`` (blocks used, so sparse or linked files count once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root in paths:
        for path in [root, *root.rglob("*")] if root.is_dir() else [root] if root.exists() else []:
            st = path.lstat()
            if path.is_file() and not path.is_symlink() and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _run(hub: Hub, cmd: list[str], env: dict[str, str]) -> tuple[float, tuple[int, int]]:
    hub.reset()
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, hub.stats()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="qwen3-0.6b")
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--budget", default="10%", help="budget of the later merge")
    parser.add_argument("--mb-per-second", type=float, default=50.0, help="bandwidth cap of one CDN connection")
    args = parser.parse_args(argv)
    workload = ensure_workload(args.layout, args.experts)
    experts = [p.name for p in workload.expert_dirs(args.experts)]
    model_bytes = sum(p.stat().st_size for p in workload.base.glob("*.safetensors"))
    hub = Hub(workload.root, ["base", *experts], int(args.mb_per_second * MB))
    cfg = mergekit_runner.config(workload.base, workload.expert_dirs(args.experts), "ties", DENSITY)
    cfg["base_model"] = f"{ORG}/base"
    for model, name in zip(cfg["models"], experts):
        model["model"] = f"{ORG}/{name}"
    rows: list[tuple[str, float, int, int, int]] = []  # what, seconds, bytes, requests, disk
    try:
        with tempfile.TemporaryDirectory(prefix="hub-bench-") as tmp:
            work = Path(tmp)
            config = mergekit_runner.write_config(work / "merge.yml", cfg)
            base_env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_XET="1",
                            HF_HUB_DISABLE_TELEMETRY="1", CUDA_VISIBLE_DEVICES="")
            base_env.pop("HF_HUB_OFFLINE", None)

            env = dict(base_env, HF_HOME=str(work / "hf-mergekit"))
            for what, out in (("mergekit-yaml (downloads every repo, then merges)", work / "out-mergekit"),
                              ("mergekit-yaml again (its cache full)", work / "out-mergekit-2")):
                seconds, (requests, sent) = _run(hub, mergekit_runner.command(config, out), env)
                rows.append((what, seconds, sent, requests, _disk(work / "hf-mergekit", out)))

            mergepipe = [str(Path(mergekit_runner.executable()).with_name("mergepipe")), "merge", "--config",
                         str(config)]
            runs = (("mergepipe first merge @ 100% (register, analyze, merge)", "100%", "hf-mergepipe"),
                    (f"mergepipe later merge @ {args.budget} (its cache full)", args.budget, "hf-mergepipe"),
                    (f"mergepipe merge @ {args.budget}, analysed catalog, empty cache (a teammate)", args.budget,
                     "hf-teammate"))
            for i, (what, budget, home) in enumerate(runs):
                env = dict(base_env, HF_HOME=str(work / home), MERGEPIPE_DB=str(work / "catalog.db"))
                out = work / f"out-mergepipe-{i}"
                seconds, (requests, sent) = _run(hub, [*mergepipe, "--budget", budget, "--out", str(out)], env)
                rows.append((what, seconds, sent, requests, _disk(work / home, *work.glob("catalog*"), out)))
    finally:
        hub.stop()
    print(f"{args.layout} ({model_bytes / GB:.2f} GB per model), base + {args.experts} experts on the fake Hub, "
          f"CDN at {args.mb_per_second:g} MB/s per connection")
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print("| run | wall s | MB transferred | requests | disk MB |")
    print("|---|---|---|---|---|")
    for what, seconds, sent, requests, disk in rows:
        print(f"| {what} | {seconds:.1f} | {sent / MB:.0f} | {requests} | {disk / MB:.0f} |")
    scale = SEVEN_B_BYTES / model_bytes
    print(f"\nProjected to 7B x {args.experts} (bf16, {SEVEN_B_BYTES / GB:.1f} GB per model: each measured "
          f"size and time x {scale:.1f}, same link):")
    print("| run | wall min | GB transferred | disk GB |")
    print("|---|---|---|---|")
    for what, seconds, sent, _, disk in rows:
        print(f"| {what} | {seconds * scale / 60:.1f} | {sent * scale / GB:.1f} | {disk * scale / GB:.1f} |")


if __name__ == "__main__":
    main()
