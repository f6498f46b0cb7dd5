"""What TLS between peers costs: the 100 MB numpy array of ``bench/throughput.py``
(client gather and worker -> worker), on a LocalCluster of 2 worker processes x 1 thread,
over plain TCP and over TLS (certificates from a throwaway CA made by ``trustme``).

Runs alternate (plain, tls; tls, plain; ...) so the machine's noise hits both alike; each
figure is the median of ``--repeats`` runs, each run the median of 3 transfers after a
warm-up.

    python bench/tls_transfer.py [--repeats 3]

Needs ``pip install -e '.[test]'`` (trustme, numpy).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _tasks
import trustme

from redisdask import Client, LocalCluster, Security, wait

ARRAY_BYTES = 100_000_000
TRANSFERS = 3
MB = 1e6


def _security(directory: Path) -> Security:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "redisdask-bench")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    cert.private_key_pem.write_to_path(str(directory / "key.pem"))
    return Security(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")


def _median_rate(once: Any) -> float:
    times = [once() for _ in range(TRANSFERS + 1)][1:]  # the first is a warm-up
    return ARRAY_BYTES / MB / statistics.median(times)


def run(security: Security) -> dict[str, float]:
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, nanny=False, security=security) as cluster,
        Client(cluster) as client,
    ):
        first, second = sorted(client.scheduler_info()["workers"])[:2]
        scheme = first.partition("://")[0]
        assert scheme == security.scheme, (first, security.scheme)
        a = client.submit(_tasks.make_array, ARRAY_BYTES, workers=[first], pure=False)
        a.result()  # a warm-up gather

        def gather() -> float:
            t0 = time.perf_counter()
            value = client.gather(a)
            dt = time.perf_counter() - t0
            assert value.nbytes == ARRAY_BYTES
            del value
            gc.collect()
            return dt

        def worker_to_worker() -> float:
            made = client.submit(_tasks.make_array, ARRAY_BYTES, workers=[first], pure=False)
            wait([made], timeout=120)
            t0 = time.perf_counter()
            nbytes = client.submit(_tasks.consume, made, workers=[second], pure=False).result()
            dt = time.perf_counter() - t0
            assert nbytes == ARRAY_BYTES
            del made
            time.sleep(0.2)  # let the workers drop their copies
            return dt

        return {
            "gather_MBps": _median_rate(gather),
            "w2w_MBps": _median_rate(worker_to_worker),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        kinds = {"tcp": Security(), "tls": _security(Path(tmp))}
        results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
        for r in range(args.repeats):
            order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
            for kind in order:
                results[kind].append(run(kinds[kind]))
                print(f"run {r + 1} {kind}: {results[kind][-1]}", flush=True)
    print(f"\n100 MB array, median of {args.repeats} runs (each the median of {TRANSFERS}):")
    print(f"{'':28}{'tcp':>10}{'tls':>10}{'tls/tcp':>10}")
    for metric, label in (
        ("gather_MBps", "client gather, MB/s"),
        ("w2w_MBps", "worker->worker, MB/s"),
    ):
        tcp = statistics.median(r[metric] for r in results["tcp"])
        tls = statistics.median(r[metric] for r in results["tls"])
        print(f"{label:28}{tcp:>10,.0f}{tls:>10,.0f}{tls / tcp:>10.2f}")


if __name__ == "__main__":
    main()
