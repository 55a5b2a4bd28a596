"""Experts behind a throttled loopback server: MergePipe's ranged reads vs download-everything-then-merge.

Usage: ``python -m benchmarks.remote_bench [--layout qwen3-0.6b] [--experts 4 8] [--budgets 100% 25% 10%]
[--mb-per-second 100] [--server http|s3]``

The workload (``workloads.py``: a base and K experts at a real layout) is
served from 127.0.0.1 by a server in its own process that caps every response
at a fixed rate (one connection's bandwidth, ``--mb-per-second``), so results
depend on the link, not on the page cache. ``http`` is the Range server of the
tests (files served from disk); ``s3`` is moto (objects held in memory: small
layouts only). Bytes and requests come from the server's own log.

Rows, per K:

- ``download everything`` then ``full-read merge of the copies``: what people
  do today: fetch every file of the base and the experts in full (concurrent
  8 MiB range requests, the transport MergePipe uses), then a full-read TIES
  merge of the local copies (``naive_merge.py``, as mergekit does it);
- ``analyze (once)``: MergePipe's one-time pass over each expert (hashes and
  statistics; reused by every later merge and plan);
- ``merge @ B``: ``plan`` + ``execute`` at budget B, reading the planned blocks
  only (the base in full: the output is the base plus merged deltas).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import naive_merge
from benchmarks.checkpoints import sidecar_files, weight_files
from benchmarks.workloads import ensure_workload
from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.storage.location import RemotePath
from mergepipe.storage.remote import RemoteClient
from mergepipe.storage.source import CheckpointSource
from mergepipe.spec.request import MergeRequest
from tests.fixtures.remote import RangeServer, S3Server

MB = 1_000_000
DENSITY = 0.5


def _serve(kind: str, root: Path, names: list[str], rate: float, conn) -> None:
    """The server process: serve ``root`` (or upload it to moto), then answer ``stats``/``reset``/``stop``."""
    server = RangeServer(root, rate) if kind == "http" else S3Server(rate)
    with server:
        if kind == "s3":
            for name in names:
                server.upload(root / name, "models", name)
            conn.send(("s3://models", server.env()))
        else:
            conn.send((server.url, {}))
        while (command := conn.recv()) != "stop":
            items = server.log.items
            if command == "reset":
                server.log.clear()
            conn.send((len(items), sum(r.range[1] - r.range[0] for r in items if r.range and r.status == 206)))


class Remote:
    """The server process and its counters."""

    def __init__(self, kind: str, root: Path, names: list[str], rate: float) -> None:
        self._conn, child = multiprocessing.Pipe()
        self._proc = multiprocessing.get_context("fork").Process(target=_serve, args=(kind, root, names, rate, child),
                                                                 daemon=True)
        self._proc.start()
        self.url, env = self._conn.recv()
        os.environ.update(env)

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


def _download(remote: Remote, names: list[str], local: dict[str, Path], into: Path) -> None:
    """Every file of each model, in full, each with concurrent 8 MiB range requests."""
    client = RemoteClient()
    source = CheckpointSource()
    for name in names:
        (into / name).mkdir(parents=True)
        files = [p.name for p in weight_files(local[name]) + sidecar_files(local[name])]
        if (local[name] / naive_merge.INDEX_NAME).exists():
            files.append(naive_merge.INDEX_NAME)

        def fetch(file: str, name: str = name) -> None:
            uri = RemotePath(f"{remote.url}/{name}/{file}")
            stat = client.stat(uri)
            with open(into / name / file, "wb") as out:
                out.write(source.read(uri, 0, stat.size))

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(fetch, files))
    source.close()


def _row(k: int, what: str, seconds: float, stats: tuple[int, int]) -> str:
    return f"| {k} | {what} | {seconds:.1f} | {stats[1] / MB:.0f} | {stats[0]} |"


def bench_k(remote: Remote, workload, k: int, budgets: list[str], work: Path) -> list[str]:
    names = ["base", *(p.name for p in workload.expert_dirs(k))]
    local = {"base": workload.base, **{p.name: p for p in workload.expert_dirs(k)}}
    rows = []
    remote.reset()
    started = time.perf_counter()
    _download(remote, names, local, work / "download")
    downloaded = time.perf_counter()
    rows.append(_row(k, "download everything", downloaded - started, remote.stats()))
    naive_merge.merge(work / "download" / "base", [work / "download" / n for n in names[1:]], work / "naive",
                      "ties", density=DENSITY)
    rows.append(_row(k, "then full-read merge of the copies", time.perf_counter() - downloaded, (0, 0)))
    shutil.rmtree(work / "download")
    shutil.rmtree(work / "naive")
    with Catalog.create(work / "c.db") as catalog:
        remote.reset()
        started = time.perf_counter()
        for name in names:
            register_model(catalog, name, f"{remote.url}/{name}")
        rows.append(_row(k, "register (headers)", time.perf_counter() - started, remote.stats()))
        remote.reset()
        started = time.perf_counter()
        analyze(catalog, names[1:], base_id="base", progress=False)
        rows.append(_row(k, "analyze (once)", time.perf_counter() - started, remote.stats()))
        for budget in budgets:
            remote.reset()
            started = time.perf_counter()
            plan = Planner(catalog).plan(MergeRequest(base="base", experts=names[1:], operator="ties", budget=budget, params={"density": DENSITY}))
            out = work / f"out-{k}-{budget[:-1]}"
            Engine(catalog, progress=False).execute(plan, out=out, model_id=f"m{budget[:-1]}")
            rows.append(_row(k, f"merge @ {budget}", time.perf_counter() - started, remote.stats()))
            shutil.rmtree(out)
    (work / "c.db").unlink()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="qwen3-0.6b")
    parser.add_argument("--experts", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--budgets", nargs="+", default=["100%", "25%", "10%"])
    parser.add_argument("--mb-per-second", type=float, default=100.0, help="bandwidth cap of one connection")
    parser.add_argument("--server", choices=["http", "s3"], default="http")
    args = parser.parse_args(argv)
    workload = ensure_workload(args.layout, max(args.experts))
    names = ["base", *(p.name for p in workload.expert_dirs(max(args.experts)))]
    remote = Remote(args.server, workload.root, names, args.mb_per_second * MB)
    rows = ["| K | what | wall s | MB transferred | requests |", "|---|---|---|---|---|"]
    try:
        for k in args.experts:
            with tempfile.TemporaryDirectory(prefix="remote-bench-") as tmp:
                rows += bench_k(remote, workload, k, args.budgets, Path(tmp))
    finally:
        remote.stop()
    print(f"{args.layout}, {args.server} on 127.0.0.1 at {args.mb_per_second:g} MB/s per connection")
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print("\n".join(rows))


if __name__ == "__main__":
    main()
